"""Exact resume through the CLI: a run stopped at an epoch boundary or mid-epoch and resumed
must end bit-identical to an uninterrupted run (weights, optimizer, scheduler, metrics), and
its TensorBoard curves must continue without duplicated steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_tensors,
    read_metrics,
    read_scalars,
    run_cli,
    run_cli_in_process,
    run_dirs,
)

# Tiny but not trivial: dropout (so the RNG state matters), SGD with momentum (optimizer
# state), a per-epoch step schedule (scheduler state), and log steps that do not divide the
# stop step (pending train-metric accumulators).
TINY = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "scheduler=step", "scheduler.step_size=1",
    "scheduler.gamma=0.5", "trainer.log_every_n_steps=2", "trainer.max_epochs=3",
]
# Steps per epoch: 12 with one worker, 6 with two. The stops: the end of epoch 0, and an odd
# step inside epoch 0 (one worker) or epoch 1 (two workers).
STOPS = {  # the resume lifts the stop (it keeps the run's own values otherwise)
    (1, "epoch"): ["trainer.max_epochs=1"],
    (1, "mid"): ["trainer.max_steps=5"],
    (2, "epoch"): ["trainer.max_epochs=1"],
    (2, "mid"): ["trainer.max_steps=9"],
}


def procs_args(procs: int) -> list[str]:
    return [f"trainer.procs={procs}"] if procs > 1 else []


def new_run(cwd: Path, args: list[str], timeout: float = 150) -> Path:
    """Run the CLI in ``cwd`` and return the run dir it created."""
    before = set(run_dirs(cwd / "outputs"))
    run_cli(args, cwd, timeout=timeout)
    (run_dir,) = set(run_dirs(cwd / "outputs")) - before
    return run_dir


def assert_same_final_state(resumed: Path, reference: Path) -> None:
    a = torch.load(resumed / "checkpoints/last.pt", weights_only=True)
    b = torch.load(reference / "checkpoints/last.pt", weights_only=True)
    for key in ("model", "optimizer", "scheduler", "epoch", "batch", "step"):
        assert_same_tensors(a[key], b[key], key)
    ma, mb = read_metrics(resumed), read_metrics(reference)
    assert ma["status"] == mb["status"] == "completed"
    assert (ma["epochs"], ma["steps"]) == (mb["epochs"], mb["steps"])
    assert ma["final"] == mb["final"]
    # Every validation of the reference run appears, equal, in the resumed run's history (a
    # max_steps stop adds one validation of its own at the stop step).
    for entry in mb["history"]:
        assert entry in ma["history"], entry


def assert_tensorboard_continues(resumed: Path, reference: Path) -> None:
    """No tag has a duplicated or out-of-order step, and the curves that do not depend on
    wall time equal the uninterrupted run's at every step both have."""
    got, want = read_scalars(resumed / "tb"), read_scalars(reference / "tb")
    assert len(list((resumed / "tb").glob("events.out.tfevents.*"))) == 2
    for tag, points in got.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: steps {steps}"
    for tag in ("val/loss", "val/acc", "train/loss", "train/acc", "train/lr", "train/grad_norm"):
        ref = dict(want[tag])
        shared = [(s, v) for s, v in got[tag] if s in ref]
        assert len(shared) == len(ref), f"{tag}: steps {sorted(ref)} missing from the resumed run"
        for step, value in shared:
            assert value == ref[step], f"{tag} at step {step}: {value} != {ref[step]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, Path]:
    """Run B: the full-length run, once per world size (shared by the cases below)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    return {procs: new_run(cwd, [*TINY, *procs_args(procs)]) for procs in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("procs,where", list(STOPS))
def test_resume_is_bit_identical(workdir, uninterrupted, procs, where):
    stopped = new_run(workdir, [*TINY, *procs_args(procs), *STOPS[(procs, where)]])
    before = torch.load(stopped / "checkpoints/last.pt", weights_only=True)
    assert before["world_size"] == procs and len(before["ranks"]) == procs
    if where == "mid":
        assert 0 < before["batch"] < 12 // procs
    else:
        assert (before["epoch"], before["batch"]) == (1, 0)
    config_before = (stopped / ".hydra/config.yaml").read_text()

    lift = ["trainer.max_steps=null"] if where == "mid" else []  # TINY sets max_epochs
    res = run_cli([*TINY, *procs_args(procs), *lift, f"resume={stopped}"], workdir, timeout=150)

    # resume=<run dir> continues in that dir: no new run dir, the first config kept.
    assert set(run_dirs(workdir / "outputs")) == {stopped}
    assert (stopped / ".hydra/config.yaml").read_text() == config_before
    assert (stopped / ".hydra/resume-1/config.yaml").is_file()
    assert f"resumed from {stopped}/checkpoints/last.pt" in res.output
    assert_same_final_state(stopped, uninterrupted[procs])
    assert_tensorboard_continues(stopped, uninterrupted[procs])


@pytest.mark.slow
def test_resume_auto_into_run_dir(workdir, uninterrupted):
    run_dir = workdir / "outputs" / "mine"
    first = run_cli_in_process([*TINY, "trainer.max_steps=5", f"hydra.run.dir={run_dir}"], workdir)
    assert "resumed from" not in first.output
    res = run_cli_in_process([*TINY, "trainer.max_steps=null", "resume=auto",
                              f"hydra.run.dir={run_dir}"], workdir)
    assert f"resumed from {run_dir}/checkpoints/last.pt" in res.output
    assert_same_final_state(run_dir, uninterrupted[1])
    assert_tensorboard_continues(run_dir, uninterrupted[1])


def test_resume_auto_without_checkpoint_starts_afresh(workdir):
    run_dir = workdir / "outputs" / "fresh"
    res = run_cli_in_process([*TINY, "trainer.max_steps=3", "resume=auto",
                              f"hydra.run.dir={run_dir}"], workdir)
    assert "resumed from" not in res.output
    assert f"resume=auto: no checkpoint in {run_dir}/checkpoints, starting from scratch" in res.output
    assert read_metrics(run_dir)["steps"] == 3
