"""``trainer.async_save`` through the CLI: a run killed while a checkpoint is written in the
background resumes bit-exact from the previous one. (A background write that meets a full
disk: tests/e2e/test_full_disk.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_tensors,
    finish,
    read_metrics,
    run_cli_in_process,
    start_cli,
    wait_for,
)

from ddpexp.checkpoint import io as ckpt_io

PLUGINS = str(Path(__file__).parents[1] / "plugins")
# test_checkpoint_resume's tiny run (dropout, momentum, a schedule), saved every 2 steps in
# the background: 12 steps an epoch, 3 epochs.
ARGS = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "scheduler=step", "scheduler.step_size=1",
    "scheduler.gamma=0.5", "trainer.log_every_n_steps=2", "trainer.max_epochs=3",
    "trainer.ckpt_every_steps=2", "trainer.async_save=true", "trainer.progress_bar=false",
]


@pytest.mark.slow
def test_a_kill_during_a_background_write_leaves_the_previous_last_pt_resumable(workdir):
    reference = workdir / "reference"
    run_cli_in_process([*ARGS, f"hydra.run.dir={reference}"], workdir)

    run, marker = workdir / "killed", workdir / "holding"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}
    proc = start_cli([*ARGS, "+callbacks.slowsave._target_=slowsave.SlowSave",
                      "+callbacks.slowsave.at=2", f"+callbacks.slowsave.marker={marker}",
                      f"hydra.run.dir={run}"], workdir, env)
    try:
        wait_for(marker, proc, nonempty=True)  # the second save (step 4) copied, its write held
        last = run / "checkpoints" / ckpt_io.LAST
        before = last.read_bytes()
        assert marker.read_text() == "4"
        assert torch.load(last, weights_only=True)["step"] == 2
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        res = finish(proc, 30)
    assert res.returncode == -signal.SIGKILL and not res.leftovers
    assert last.read_bytes() == before  # the previous checkpoint, whole
    ckpt_io.check_digest(last)

    resumed = run_cli_in_process([*ARGS, f"resume={run}"], workdir)
    assert f"resumed from {last} at epoch 0, batch 2, step 2" in resumed.output
    a = torch.load(last, weights_only=True)
    b = torch.load(reference / "checkpoints" / ckpt_io.LAST, weights_only=True)
    for key in ("model", "optimizer", "scheduler", "epoch", "batch", "step"):
        assert_same_tensors(a[key], b[key], key)
    assert read_metrics(run)["final"] == read_metrics(reference)["final"]
    assert not [p for p in last.parent.iterdir() if ".tmp-" in p.name]

