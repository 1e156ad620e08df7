"""The ``experiment`` and ``debug`` config groups: every shipped recipe composes and trains a
few steps under ``debug=fast``; recipes in a sweep; the debug configs and the trainer keys
behind them (limits, overfit, profile, anomaly) alone and under DDP."""

from __future__ import annotations

import json

import pytest
from helpers import read_metrics, run_cli, run_dirs

from ddpexp import report


@pytest.mark.slow
def test_debug_fast_two_workers_ends_quickly_and_quietly(workdir):
    res = run_cli(["debug=fast", "trainer.procs=2"], workdir, timeout=120)
    (run_dir,) = run_dirs(workdir / "outputs")
    assert run_dir.relative_to(workdir / "outputs").parts[0] == "debug"
    metrics = read_metrics(run_dir)
    assert (metrics["status"], metrics["world_size"], metrics["steps"]) == ("completed", 2, 2)
    assert not list(workdir.rglob("summary.csv"))
    assert "sweep summary" not in res.output
    # The report of all runs leaves debug runs out; asked for, it shows them.
    assert report.collect(workdir / "outputs") == []
    assert [r.status for r in report.collect(workdir / "outputs" / "debug")] == ["completed"]


@pytest.mark.slow
def test_overfit_and_profile_under_ddp(workdir):
    run_cli(["trainer.procs=2", "trainer.overfit_batches=1", "trainer.max_epochs=3",
             "trainer.profile_steps=1", "data.batch_size=8"], workdir, timeout=120)
    (run_dir,) = run_dirs(workdir / "outputs")
    metrics = read_metrics(run_dir)
    assert (metrics["status"], metrics["steps"]) == ("completed", 3)  # 1 batch per worker, 3 epochs
    assert json.loads((run_dir / "profile" / "trace.json").read_text())["traceEvents"]


@pytest.mark.slow
def test_experiments_in_a_sweep(workdir):
    res = run_cli(["-m", "experiment=digits_convnet,diabetes_mlp", "debug=fast"], workdir,
                  timeout=180)
    (sweep,) = list((workdir / "outputs" / "debug" / "multirun").glob("*/*"))
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 3, rows
    by_job = {p.name: read_metrics(p) for p in sweep.iterdir() if (p / "metrics.json").exists()}
    assert by_job["0"]["monitor"] == "val/acc" and by_job["1"]["monitor"] == "val/mse"
    assert all(m["status"] == "completed" and m["steps"] == 2 for m in by_job.values())
    assert "experiment=diabetes_mlp" in res.output
