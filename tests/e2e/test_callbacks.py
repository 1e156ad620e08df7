"""The callbacks seam: a user's own callback from their config dir under DDP (its scalar in
every logger, its state through SIGTERM and resume, a stop asked by one rank), the built-in
features as removable callbacks whose state survives a resume, the order of the events, and
one message for each kind of bad entry."""

from __future__ import annotations

import csv
import signal
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_tensors,
    read_metrics,
    read_scalars,
    run_cli,
    session_pids,
    start_cli,
)
from test_checkpoint_signals import check_interrupted, interrupt

ARGS = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "trainer.log_every_n_steps=2",
]

PROBE = '''
import ddpexp


class Probe(ddpexp.Callback):
    """Counts optimizer steps (state a resume must keep), logs the count each epoch, and can
    ask for a stop from one rank only."""

    def __init__(self, stop_rank=None, stop_step=None):
        self.stop_rank, self.stop_step = stop_rank, stop_step
        self.steps = 0

    def on_train_batch_end(self, trainer):
        self.steps += 1
        if trainer.rank == self.stop_rank and trainer.step == self.stop_step:
            trainer.request_stop(f"probe asked at step {trainer.step}")

    def on_train_epoch_end(self, trainer, metrics):
        trainer.log_metrics({"probe/steps": self.steps, "probe/twice_val_loss": 2 * metrics["val/loss"]})

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]
'''


@pytest.fixture
def user_conf(tmp_path: Path) -> tuple[Path, dict]:
    """A user's config dir holding their callback's module and a callbacks option that adds
    it to the defaults; the environment that puts the module on the path."""
    conf = tmp_path / "my_conf"
    (conf / "callbacks").mkdir(parents=True)
    (conf / "probe_cb.py").write_text(PROBE)
    (conf / "callbacks" / "with_probe.yaml").write_text(textwrap.dedent("""\
        defaults:
          - default
        probe:
          _target_: probe_cb.Probe
        """))
    return conf, {"PYTHONPATH": str(conf)}


def user_args(conf: Path) -> list[str]:
    return ["--config-dir", str(conf), *ARGS, "callbacks=with_probe", "logger=[tensorboard,csv]",
            "trainer.procs=2"]


def csv_points(run_dir: Path, name: str) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(f) if r["name"] == name]


@pytest.mark.slow
def test_user_callback_under_ddp_logs_and_keeps_its_state_through_sigterm(workdir, user_conf):
    conf, env = user_conf
    args = user_args(conf)
    run_dir, res, took = interrupt(workdir, [*args, "trainer.ckpt_every_steps=3"], signal.SIGTERM, env=env)
    ckpt = check_interrupted(run_dir, res, took, "SIGTERM")
    assert ckpt["callbacks"]["probe"]["steps"] == ckpt["step"]  # saved where the run stopped
    length = f"trainer.max_epochs={ckpt['epoch'] + 2}"
    run_cli([*args, "trainer.ckpt_every_steps=3", length, f"resume={run_dir}"], workdir, env=env)
    reference = workdir / "outputs" / "reference"
    run_cli([*args, "trainer.ckpt_every_steps=3", length, f"hydra.run.dir={reference}"], workdir, env=env)
    a = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    b = torch.load(reference / "checkpoints/last.pt", weights_only=True)
    for key in ("model", "optimizer", "step", "callbacks"):
        assert_same_tensors(a[key], b[key], key)
    assert a["callbacks"]["probe"]["steps"] == a["step"]  # not restarted at the resume
    # The callback's scalar, in TensorBoard and metrics.csv, each step once, as uninterrupted.
    for read in (lambda d: read_scalars(d / "tb")["probe/steps"], lambda d: csv_points(d, "probe/steps")):
        got, want = read(run_dir), read(reference)
        assert got == want and [s for s, _ in got] == sorted({s for s, _ in got})
        assert got[-1] == (a["step"], float(a["step"]))


@pytest.mark.slow
def test_a_stop_asked_by_rank_one_alone_ends_every_rank(workdir, user_conf):
    conf, env = user_conf
    proc = start_cli([*user_args(conf), "trainer.max_epochs=50", "+callbacks.probe.stop_rank=1",
                      "+callbacks.probe.stop_step=3"], workdir, env)
    from helpers import finish, only_run_dir

    res = finish(proc, 120)
    assert not res.leftovers and not session_pids(proc.pid)
    assert res.returncode == 0, res.output
    run_dir = only_run_dir(workdir)
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "stopped"
    assert "rank 1: probe asked at step 3" in metrics["stop_reason"]
    # Asked at step 3 of the first epoch (6 steps per rank): agreed at the next log step,
    # validated, checkpointed, ended; the epoch never finished.
    assert metrics["steps"] == 4 and metrics["epochs"] == 0
    assert torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["step"] == 4
    assert "stop requested (rank 1: probe asked at step 3)" in res.output
    assert "test/acc" in metrics["test"]
