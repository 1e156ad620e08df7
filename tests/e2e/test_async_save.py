"""``trainer.async_save`` through the CLI: a run killed while a checkpoint is written in the
background resumes bit-exact from the previous one; under fsdp (2 gloo workers, DCP's async
save) the sharded checkpoint written in the background equals the one written in the loop at
the same step, resumes bit-exact, and the run ends once its last save is in place. (A
background write that meets a full disk: tests/e2e/test_full_disk.py.)"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from helpers import (
    TINY_GPT,
    assert_same_tensors,
    finish,
    plugins_env,
    read_metrics,
    run_cli,
    run_cli_in_process,
    start_cli,
    wait_for,
    write_corpus,
)

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import sharded as ckpt_sharded

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
    env = plugins_env()
    proc = start_cli([*ARGS, "+callbacks.slowsave._target_=slowsave.SlowSave",
                      "+callbacks.slowsave.at=2", f"+callbacks.slowsave.marker={marker}",
                      f"hydra.run.dir={run}"], workdir, env)
    try:
        wait_for(marker, proc, nonempty=True)  # the second save (step 4) copied, its write held
        last = run / "checkpoints" / ckpt_files.LAST
        before = last.read_bytes()
        assert marker.read_text() == "4"
        assert torch.load(last, weights_only=True)["step"] == 2
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        res = finish(proc, 30)
    assert res.returncode == -signal.SIGKILL and not res.leftovers
    assert last.read_bytes() == before  # the previous checkpoint, whole
    ckpt_files.check_digest(last)

    # The resume keeps the run's overrides but for the callback it takes out again.
    resumed = run_cli_in_process([*ARGS, "~callbacks.slowsave", f"resume={run}"], workdir)
    assert f"resumed from {last} at epoch 0, batch 2, step 2" in resumed.output
    a = torch.load(last, weights_only=True)
    b = torch.load(reference / "checkpoints" / ckpt_files.LAST, weights_only=True)
    for key in ("model", "optimizer", "scheduler", "epoch", "batch", "step"):
        assert_same_tensors(a[key], b[key], key)
    assert read_metrics(run)["final"] == read_metrics(reference)["final"]
    assert not [p for p in last.parent.iterdir() if ".tmp-" in p.name]



# The tiny GPT sharded over 2 gloo workers, 6 steps of one epoch; the default
# trainer.async_save (null) writes its checkpoints in the background.
FSDP = [*TINY_GPT, "optimizer=adamw", "trainer.strategy=fsdp", "trainer.procs=2",
        "data.batch_size=8", "trainer.max_steps=6", "trainer.test=false",
        "trainer.progress_bar=false"]


@pytest.mark.slow
def test_an_fsdp_background_save_equals_the_save_in_the_loop_and_resumes_bit_exact(workdir):
    """At step 2 every rank saves in the loop (sync.pt), then in the background (async.pt),
    its write held until the loop has taken 2 more steps that change the weights in place:
    the two sharded checkpoints hold the same tensors. The run's last save (held too) is in
    place when the run ends, and a run resumed from async.pt ends with the weights, optimizer
    state and metrics of the uninterrupted one."""
    write_corpus(workdir / "text.txt")
    run = workdir / "run"
    run_cli([*FSDP, "+callbacks.savetwice._target_=savetwice.SaveTwice",
             f"hydra.run.dir={run}"], workdir, env=plugins_env(), timeout=240)
    reports = [json.loads((run / f"report.{rank}.json").read_text()) for rank in (0, 1)]
    for seen in reports:
        assert seen["busy_while_training"][:2] == [True, True], seen  # written while stepping
        assert seen["moved"] and seen["held"] >= 2 and seen["busy_at_end"] is False, seen
    assert reports[0]["last_step"] == 6 and reports[0]["temporaries"] == []
    out = run / "checkpoints"
    written = ckpt_sharded.load_sharded(out / "async.pt", keys=ckpt_sharded.SHARDED_KEYS)
    sync = ckpt_sharded.load_sharded(out / "sync.pt", keys=ckpt_sharded.SHARDED_KEYS)
    assert written["step"] == 2
    assert_same_tensors(written, sync, "checkpoint")
    ckpt_files.check_digest(out / "async.pt")

    resumed = workdir / "resumed"
    res = run_cli([*FSDP, f"resume={out / 'async.pt'}", f"hydra.run.dir={resumed}"], workdir,
                  timeout=240)
    assert "resumed from" in res.output and "step 2" in res.output
    a = ckpt_sharded.load_sharded(resumed / "checkpoints" / ckpt_files.LAST, keys=ckpt_sharded.SHARDED_KEYS)
    b = ckpt_sharded.load_sharded(out / ckpt_files.LAST, keys=ckpt_sharded.SHARDED_KEYS)
    for key in ("model", "optimizer", "epoch", "batch", "step"):
        assert_same_tensors(a[key], b[key], key)
    assert read_metrics(resumed)["final"] == read_metrics(run)["final"]
    assert not [p for p in (resumed / "checkpoints").iterdir() if ".tmp-" in p.name]
