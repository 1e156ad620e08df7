"""The foundation end to end: a real run through the CLI and the files it leaves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    FAST,
    finish,
    only_run_dir,
    read_metrics,
    read_scalars,
    run_cli,
    run_dirs,
    start_cli,
)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, object]:
    """One default run (the README's quick start), shared by the checks below."""
    cwd = tmp_path_factory.mktemp("default")
    res = run_cli([], cwd, timeout=120)
    return only_run_dir(cwd), res


def test_default_run_reaches_90_percent_on_digits(default_run):
    run_dir, res = default_run
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed"
    assert metrics["best"]["val/acc"] >= 0.90
    assert metrics["wall_time_s"] < 60
    assert f"run dir: {run_dir}" in res.output


def test_run_dir_layout(default_run):
    run_dir, _ = default_run
    rel = run_dir.relative_to(run_dir.parents[2])
    date, time_ = rel.parts[1], rel.parts[2]
    assert len(date.split("-")) == 3 and len(time_.split("-")) == 3
    for name in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml",
                 "ddpexp.log", "metrics.json", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (run_dir / name).is_file(), name
    assert "val/acc" in (run_dir / "ddpexp.log").read_text()
    cfg = yaml.safe_load((run_dir / ".hydra/config.yaml").read_text())
    assert cfg["model"]["_target_"] == "ddpexp.models.ConvNet"
    assert cfg["data"]["_target_"] == "ddpexp.data.Digits"
    assert cfg["optimizer"]["_target_"] == "torch.optim.SGD"


def test_tensorboard_events_readable(default_run):
    run_dir, _ = default_run
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    scalars = read_scalars(run_dir / "tb")
    metrics = read_metrics(run_dir)
    for tag in ("train/loss", "train/lr", "val/loss", "val/acc"):
        assert scalars.get(tag), tag
    assert len(scalars["val/acc"]) == metrics["epochs"]
    assert scalars["val/acc"][-1][1] == pytest.approx(metrics["final"]["val/acc"])
    assert scalars["train/lr"][0][1] == pytest.approx(0.05)
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == sorted(steps) and steps[0] == 20


def test_checkpoint_loads_weights_only_and_reproduces_val_acc(default_run):
    from ddpexp.data import Digits
    from ddpexp.models import ConvNet

    run_dir, _ = default_run
    metrics = read_metrics(run_dir)
    for name, key in (("best.pt", "best"), ("last.pt", "final")):
        ckpt = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert not any(k.startswith("module.") for k in ckpt["model"])
        model = ConvNet(input_shape=[1, 8, 8], num_classes=10)
        model.load_state_dict(ckpt["model"])
        model.eval()
        _, val, _ = Digits(batch_size=64).load()
        with torch.no_grad():
            acc = (model(val.x).argmax(1) == val.y).float().mean().item()
        expected = metrics[key]["val/acc"]
        assert acc == pytest.approx(expected, abs=1e-6), name
        assert ckpt["config"]["trainer"]["max_epochs"] == 10


def test_same_second_runs_get_different_dirs(workdir):
    run_dir = "outputs/2026-01-01/00-00-00"
    args = [*FAST, "trainer.max_steps=2", "model=mlp"]
    # Both runs resolve hydra.run.dir to the same second: the second must not reuse it.
    override = f"hydra.run.dir=${{ddpexp.unique_dir:{run_dir}}}"
    procs = [start_cli([*args, override], workdir) for _ in range(2)]
    results = [finish(p, 120) for p in procs]
    for res in results:
        assert res.returncode == 0, res.stderr
    dirs = run_dirs(workdir / "outputs")
    assert [d.name for d in dirs] == ["00-00-00", "00-00-00-1"]
    for d in dirs:
        assert read_metrics(d)["status"] == "completed"


def test_console_script_and_mlp(workdir):
    import shutil

    exe = shutil.which("ddpexp")
    assert exe, "the ddpexp console script is not installed"
    import subprocess

    res = subprocess.run([exe, "model=mlp", *FAST], cwd=workdir, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    run_dir = only_run_dir(workdir)
    assert read_metrics(run_dir)["epochs"] == 2
    cfg = yaml.safe_load((run_dir / ".hydra/config.yaml").read_text())
    assert cfg["model"]["_target_"] == "ddpexp.models.MLP"


def test_max_steps_stops_and_metrics_json(workdir):
    run_cli(["trainer.max_steps=7", "trainer.log_every_n_steps=2", "data=synthetic",
             "data.shape=[3,5,7]", "data.num_classes=3", "data.num_samples=256"], workdir)
    run_dir = only_run_dir(workdir)
    m = read_metrics(run_dir)
    assert m["steps"] == 7 and m["status"] == "completed"
    assert json.loads((run_dir / "metrics.json").read_text())["final"]["val/acc"] >= 0
