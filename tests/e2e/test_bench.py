"""scripts/bench.py runs end to end on a tiny case and prints every figure (not their values:
timings on a shared 2-core machine are not something a test can hold to)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import finish

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["case", "runner", "samples/s", "speed ratio", "wall s", "wall ratio", "first step s",
           "max RSS MiB", "memory ratio"]


def _number(cell: str) -> float:
    match = re.fullmatch(r"-?\d+(?:\.\d+)?", cell.strip())
    assert match, f"not a number: {cell!r}"
    return float(match.group(0))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick_prints_every_figure(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.Popen(
        # A case of each kind (compute's runners, rows and verdict are overhead's, on another
        # model), and the launchers case (an 8-job sweep under ddpexp's and Hydra's launchers,
        # a 2-job one with --quick).
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick", "--cases", "overhead",
         "startup", "sweep", "launchers"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    res = finish(proc, timeout=840)
    assert res.returncode == 0, res.output
    assert not res.leftovers, f"processes left behind: {res.leftovers}"

    before, launchers = res.stdout.split("\nlaunchers: ", 1)
    lines = [line for line in before.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0].split(" ")[0], cells[1])] = dict(zip(COLUMNS, cells, strict=False))
    expected = {("overhead", r) for r in ("ddpexp", "ddpexp-dl", "plain")}
    expected |= {("startup", "ddpexp"), ("startup", "plain"), ("sweep", "ddpexp"), ("sweep", "plain")}
    assert set(rows) == expected

    for (case, runner), row in rows.items():
        # Every run has a wall time and a memory peak, and they are positive.
        assert _number(row["wall s"]) > 0 and _number(row["max RSS MiB"]) > 0
        if case == "overhead":
            assert _number(row["samples/s"]) > 0
        if case != "sweep":
            assert _number(row["first step s"]) > 0
        if runner == "plain":
            assert row["wall ratio"] == row["memory ratio"] == "-"
            continue
        # Ratios to the plain loop, side by side, from this one invocation.
        for column in ("wall ratio", "memory ratio"):
            assert _number(row[column]) > 0
        if case == "overhead":
            assert _number(row["speed ratio"]) > 0

    # One verdict per target, each saying met or NOT met.
    for name in ("overhead", "startup", "memory", "sweep"):
        verdict = [line for line in before.splitlines() if line.startswith(name + ":")]
        assert len(verdict) == 1 and re.search(r"(met|NOT met)", verdict[0]), res.stdout
        if name == "overhead":  # the ratio of each round's pair, too
            assert re.search(r"round by round [\d.]+ \(median of 1, from [\d.]+ to [\d.]+\)",
                             verdict[0]), verdict[0]

    # The launchers case: the same sweep under ddpexp's launcher at its defaults and Hydra's
    # basic launcher, a row each, and one verdict line.
    rows = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in launchers.splitlines()
        if line.startswith("| ") and not line.startswith("| launcher"))}
    assert {"ddp (defaults)", "basic"} <= set(rows), launchers
    assert _number(rows["basic"][2]) == 1.0
    for cells in rows.values():
        assert _number(cells[1]) > 0 and _number(cells[2]) > 0
    verdict = [line for line in launchers.splitlines() if line.startswith("sweep:")]
    assert len(verdict) == 1 and re.search(
        r"/ basic = [\d.]+ \(target <= 0\.9: (met|NOT met)\); a job's wall - train time: "
        r"median [\d.]+ s, most [\d.]+ s \(target < 1 s: (met|NOT met)\)", verdict[0]), launchers


@pytest.mark.timeout(300)
def test_step_overhead_times_both_loops_in_alternation(tmp_path: Path) -> None:
    """scripts/step_overhead.py builds the real trainer and interleaves chunks of its steps
    with the plain loop's, in one process: it prints both per-step times and their ratio."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "step_overhead.py"), "--chunks", "4",
         "--steps-per-chunk", "3"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    res = finish(proc, timeout=240)
    assert res.returncode == 0, res.output
    assert "2 alternating chunks of 3 steps" in res.stdout, res.stdout
    times = re.search(r"ms per step: plain ([\d.]+), ddpexp ([\d.]+)", res.stdout)
    ratio = re.search(r"speed ratio \(plain time / ddpexp time, totals\): ([\d.]+)", res.stdout)
    assert times and ratio, res.stdout
    assert float(times.group(1)) > 0 and float(times.group(2)) > 0 and float(ratio.group(1)) > 0

