"""A training loss that turns NaN or infinite, or rises past trainer.divergence_factor times
its start, stops the run: status ``diverged`` with the step, one message and a non-zero exit,
no checkpoint with those weights, a metrics.json that strict JSON readers accept; in a sweep
the job is a ``diverged`` row and the others go on."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import build_trainer, only_run_dir, run_cli, run_cli_here, run_dirs

from ddpexp.training.divergence import LossCeiling

# 256 train samples: 4 optimizer steps per epoch at world size 1, 2 at world size 2.
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
        "data.val_samples=64", "model=mlp", "model.hidden=[16]"]


def strict_json(path: Path) -> dict:
    """``path`` parsed as standard JSON: a bare NaN or Infinity fails."""
    def refuse(name: str) -> None:
        raise ValueError(f"{path} holds a bare {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def assert_finite_checkpoints(run_dir: Path) -> None:
    for name in ("last.pt", "best.pt"):
        path = run_dir / "checkpoints" / name
        if path.exists():
            model = torch.load(path, weights_only=True)["model"]
            assert all(torch.isfinite(t).all() for t in model.values()), name


@pytest.mark.parametrize("lr", ["1e6", "1e30"])
def test_one_worker_stops_at_the_first_non_finite_loss(tmp_path, monkeypatch, capsys, lr):
    # A checkpoint every step: divergence is agreed on before each, so none holds NaN. (No
    # ceiling on finite losses, which would stop the run before its loss is NaN.)
    code, text = run_cli_here(["model=mlp", f"optimizer.lr={lr}", "trainer.ckpt_every_steps=1",
                               "trainer.log_every_n_steps=5", "trainer.divergence_factor=null"],
                              tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text
    assert text.count("training diverged: the training loss became") == 1
    assert f"Try a smaller optimizer.lr (the last step used {float(lr):g})" in text
    run_dir = only_run_dir(tmp_path)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "diverged"
    assert 1 <= metrics["diverged_at_step"] < 23  # stopped in the first of 10 epochs
    assert metrics["steps"] == metrics["diverged_at_step"]
    assert "training diverged" in metrics["error"]
    assert_finite_checkpoints(run_dir)
    assert (run_dir / "checkpoints" / "last.pt").exists()  # the finite steps before it


def test_a_finite_explosion_of_the_loss_is_diverged(tmp_path, monkeypatch, capsys):
    """optimizer.lr=1e6 on the default run: losses near 1e22, all finite. The first log step
    (step 20 of the first epoch's 23) finds the loss past 100x its start: the run fails
    before it writes a single checkpoint."""
    code, text = run_cli_here(["optimizer.lr=1e6"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text
    assert text.count("training diverged: the training loss became") == 1
    assert "over trainer.divergence_factor=100 times its start (2.305)" in text
    run_dir = only_run_dir(tmp_path)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "diverged" and metrics["diverged_at_step"] == 20
    assert not list((run_dir / "checkpoints").glob("*.pt"))


def test_ordinary_runs_stay_under_the_ceiling(tmp_path):
    """The default run, and a regression whose loss starts below 1 (the floor of the rule)."""
    for name, overrides in {"digits": ["trainer.max_epochs=3"],
                            "diabetes": ["task=regression", "data=diabetes", "model=mlp",
                                         "trainer.max_epochs=3", "trainer.log_every_n_steps=1"]}.items():
        trainer = build_trainer(tmp_path / name, [*overrides, "trainer.test=false"])
        assert trainer.fit()["status"] == "completed", name
        start = trainer.divergence.ceiling.start
        assert 0 < start < 3 and trainer.divergence.ceiling.limit == pytest.approx(start + 99 * max(start, 1))


def test_the_ceiling_rule():
    """factor x the start for a start of at least 1; a rise of (factor - 1) in absolute terms
    for a start near zero or below it; nothing without a factor or a finite start."""
    ceiling = LossCeiling(100.0)
    for start, limit in ((2.3, 230.0), (0.01, 99.01), (-3.0, 294.0)):
        ceiling.set_start(start)
        assert ceiling.limit == pytest.approx(limit)
        assert ceiling.exceeded(limit * 1.01 + 0.01) and not ceiling.exceeded(limit - 0.01)
    ceiling.set_start(math.nan)
    assert ceiling.limit is None and not ceiling.exceeded(1e30)
    off = LossCeiling(None)
    off.set_start(2.3)
    assert not off.exceeded(1e30)


@pytest.mark.parametrize("value,message", [
    ("1", r"trainer.divergence_factor=1.0 must be > 1 \(how many times its start"),
    ("0.5", r"trainer.divergence_factor=0.5 must be > 1"),
    ("-3", r"trainer.divergence_factor=-3.0 must be > 1"),
    ("lots", r"trainer.divergence_factor=lots: trainer.divergence_factor takes a number or null, "
             r"not 'lots'"),
])
def test_bad_divergence_factors_are_refused(tmp_path, monkeypatch, capsys, value, message):
    code, text = run_cli_here([f"trainer.divergence_factor={value}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text and re.search(message, text), text
    assert not list(tmp_path.glob("outputs/**/metrics.json"))


@pytest.mark.slow
def test_two_workers_stop_together(workdir):
    res = run_cli([*TINY, "optimizer.lr=1e30", "trainer.procs=2", "trainer.max_epochs=20",
                   "trainer.log_every_n_steps=1"], workdir, expect_ok=False, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.count("training diverged: the training loss became") == 1
    run_dir = only_run_dir(workdir)
    metrics = strict_json(run_dir / "metrics.json")
    assert metrics["status"] == "diverged" and metrics["world_size"] == 2
    assert metrics["steps"] < 40  # long before the 20 epochs' end
    assert_finite_checkpoints(run_dir)


@pytest.mark.slow
def test_a_diverged_sweep_job_is_a_row_and_the_others_go_on(workdir):
    sweep_dir = workdir / "sweep"
    run_cli(["-m", *TINY, "optimizer.lr=0.05,1e30", "trainer.max_epochs=2",
             "trainer.log_every_n_steps=1", f"hydra.sweep.dir={sweep_dir}"], workdir, timeout=180)
    rows = {r["job"]: r for r in csv.DictReader((sweep_dir / "summary.csv").open())}
    assert rows["0"]["status"] == "completed"
    assert rows["1"]["status"] == "diverged" and "training diverged" in rows["1"]["error"]
    for run_dir in run_dirs(sweep_dir):
        strict_json(run_dir / "metrics.json")
    assert_finite_checkpoints(sweep_dir / "1")


def test_a_sweeper_gets_the_worst_value_for_its_direction():
    from hydra.types import RunMode

    from ddpexp.errors import RunDiverged
    from ddpexp.launch.fanout import _diverged

    sweep = SimpleNamespace(mode=RunMode.MULTIRUN)
    assert _diverged({"monitor_mode": "max", "error": "x"}, sweep) == -math.inf
    assert _diverged({"monitor_mode": "min", "error": "x"}, sweep) == math.inf
    with pytest.raises(RunDiverged, match="training diverged at"):
        _diverged({"monitor_mode": "min", "error": "training diverged at step 3"},
                  SimpleNamespace(mode=RunMode.RUN))
