"""scripts/gpu_check.sh --dry-run: the GPU check's every step on the CPU (the benchmark's GPU
cases tiny, the gpu-marked tests skipped, torch.compile's case left out), so that the script
a GPU machine runs in one go cannot rot where no GPU is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import finish

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.host  # pip install --target of the wheels it finds (the offline install path)
@pytest.mark.timeout(400)
def test_gpu_check_dry_run_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(OUT=str(out), PYTHON=sys.executable)
    wheels = ROOT.parent / "shared" / "wheels"  # where the project's checkouts find them
    if list(wheels.glob("*.whl")):
        env["GPU_CHECK_WHEELS"] = str(wheels)  # the offline install path runs too
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    res = finish(proc, timeout=360)
    assert res.returncode == 0, res.output + "".join(
        f"\n--- {p.name}\n{p.read_text()}" for p in sorted(out.glob("*")) if p.is_file())
    assert not res.leftovers, f"processes left behind: {res.leftovers}"

    report = (out / "gpu_check.md").read_text()
    assert report == res.stdout
    assert "dry run on the CPU" in report
    # Every step ran and finished in time.
    steps = (out / "steps.txt").read_text().splitlines()
    assert [s.split(":")[0] for s in steps] == ["bench", "pytest -m gpu"]
    assert all(": ok in" in s for s in steps), steps
    # The gpu-marked tests were collected and skipped (no CUDA), none failed.
    assert re.search(r"\d+ skipped", report) and "failed" not in (out / "pytest.txt").read_text()
    # One row per GPU case and runner, each with its figures; compile is named as skipped.
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| gpu-"):
            rows[(cells[0].split(" ")[0], cells[1])] = cells
    for case in ("gpu-fp32", "gpu-dp", "gpu-fsdp"):  # gpu-bf16 only on a GPU
        for runner in ("ddpexp", "plain"):
            cells = rows[(case, runner)]
            assert float(cells[2]) > 0 and float(cells[4]) > 0 and float(cells[7]) > 0, cells
    assert "bf16" in next(line for line in report.splitlines() if line.startswith("| gpu-fsdp"))
    assert "skipped: gpu-compile" in report
    figures = json.loads((out / "bench.json").read_text())
    assert {"gpu-fp32/ddpexp", "gpu-fp32/plain", "gpu-dp/ddpexp", "gpu-fsdp/ddpexp",
            "gpu-fsdp/plain"} <= set(figures)
