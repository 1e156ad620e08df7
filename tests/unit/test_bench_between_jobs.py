"""scripts/bench.py's reading of what a sweep's jobs left in their run dirs: when each did
what, what a slot lost between two jobs, and how busy the slots were."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench"]


def job_dir(root: Path, num: int, start: float, hydra: float, built: float, first: float,
            last: float, recorded: float) -> Path:
    """A run dir as a job leaves it: .hydra/config.yaml written at ``hydra``, the clock
    callback's times, metrics.json recorded at ``recorded`` with its wall time from ``start``."""
    run = root / str(num)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    os.utime(run / ".hydra" / "config.yaml", (hydra, hydra))
    (run / "job_clock.json").write_text(json.dumps({"built": built, "first": first, "last": last}))
    (run / "metrics.json").write_text(json.dumps({"wall_time_s": recorded - start}))
    os.utime(run / "metrics.json", (recorded, recorded))
    return run


def test_each_slot_is_busy_in_its_jobs_training_from_its_first_start_to_its_last_record(
        tmp_path, bench):
    t = 1_000_000.0
    dirs = [
        # slot A: job 0 then job 2; slot B: job 1 alone, then nothing left (the tail)
        job_dir(tmp_path, 0, t, t + 0.1, t + 0.2, t + 0.25, t + 1.2, t + 1.3),
        job_dir(tmp_path, 1, t, t + 0.1, t + 0.2, t + 0.25, t + 2.2, t + 2.3),
        job_dir(tmp_path, 2, t + 1.4, t + 1.5, t + 1.6, t + 1.65, t + 2.6, t + 2.7),
    ]
    busy = bench.slot_busy(dirs, slots=2)
    span = (t + 2.7 - t) + (t + 2.3 - t)
    assert busy["train"] == pytest.approx((1.0 + 2.0 + 1.0) / span)
    assert busy["held"] == pytest.approx((1.3 + 2.3 + 1.3) / span)
    (gap,) = bench.between_jobs(dirs, slots=2)
    assert gap["total"] == pytest.approx(1.65 - 1.2)  # job 0's last result to job 2's first step
    assert gap["teardown"] == pytest.approx(0.1) and gap["handover"] == pytest.approx(0.1)
    assert gap["setup"] == pytest.approx(0.1) and gap["build"] == pytest.approx(0.1)
    assert gap["first_step"] == pytest.approx(0.05)
