"""``trainer.strategy=fsdp`` against ``ddp`` with real gloo processes: the same gradients
(SGD and AdamW, clipped, accumulated, with activation checkpointing, at 2 and 4 workers),
the same validation after 20 steps, sharded checkpoints that resume bit-exactly at the same
world size and at the same sample at another one, a best.pt that the plain model loads, and
a killed worker named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_GPT,
    assert_close_grads,
    only_run_dir,
    plugins_env,
    read_metrics,
    read_scalars,
    run_cli,
    sweep_cases,
    write_corpus,
)

from ddpexp.checkpoint.sharded import is_sharded

pytestmark = pytest.mark.slow

# 256 train samples: 8 batches of 16 per rank and epoch at world size 2.
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
        "data.val_samples=101", "model=mlp", "model.hidden=[16,16]", "trainer.log_every_n_steps=1",
        "trainer.test=false"]
GRADS = ["+callbacks.grads._target_=gradprobe.SaveGrads", "+callbacks.grads.path=grads.pt"]


def grads(run_dir: Path) -> list[dict]:
    return torch.load(run_dir / "grads.pt", weights_only=True)


def val_loss(run_dir: Path) -> float:
    m = read_metrics(run_dir)
    assert m["status"] == "completed", m
    return m["final"]["val/loss"]


def test_fsdp_matches_ddp_gradients_and_validation(workdir):
    """2 workers: the first two steps' gradients (clipped to the global norm) equal ddp's
    to 1e-6 relative with SGD and AdamW, and after 20 steps val/loss is within 1e-5; two
    micro-batches of 8 give the gradients of one batch of 16."""
    # 640 samples: the 20 steps are one epoch (one validation and checkpoint per job).
    common = [*TINY, *GRADS, "data.num_samples=640", "trainer.procs=2", "trainer.max_steps=20",
              "trainer.grad_clip=0.3"]
    b16 = "data.batch_size=16"
    runs = sweep_cases(workdir, {
        "ddp_sgd": ["trainer.strategy=ddp", "optimizer=sgd", b16],
        "fsdp_sgd": ["trainer.strategy=fsdp", "optimizer=sgd", b16],
        "ddp_adamw": ["trainer.strategy=ddp", "optimizer=adamw", b16],
        "fsdp_adamw": ["trainer.strategy=fsdp", "optimizer=adamw", b16],
        "fsdp_accumulated": ["trainer.strategy=fsdp", "optimizer=adamw", "data.batch_size=8",
                             "trainer.accumulate=2"],
    }, common)
    for opt in ("sgd", "adamw"):
        ddp, fsdp = runs[f"ddp_{opt}"], runs[f"fsdp_{opt}"]
        assert_close_grads(grads(fsdp), grads(ddp), 1e-6)
        assert val_loss(fsdp) == pytest.approx(val_loss(ddp), rel=1e-5)
        assert is_sharded(fsdp / "checkpoints" / "last.pt")
    acc, whole = runs["fsdp_accumulated"], runs["fsdp_adamw"]
    assert_close_grads(grads(acc), grads(whole), 1e-6)
    assert val_loss(acc) == pytest.approx(val_loss(whole), rel=1e-5)
    assert read_metrics(acc)["steps"] == read_metrics(whole)["steps"] == 20
    # The first step is clipped (its norm is 0.48): the recorded gradients' total norm over
    # all shards is the clip.
    total = torch.stack([g.norm() for g in grads(runs["fsdp_adamw"])[0].values()]).norm()
    assert float(total) == pytest.approx(0.3, rel=1e-5)


def test_gpt_blocks_tied_weights_and_activation_checkpointing(workdir):
    """The GPT (tied embedding and output weights, dropout) sharded per transformer block:
    fsdp's gradients equal ddp's, with and without activation checkpointing, at 2 workers
    and at 4; checkpointing changes no gradient under either strategy."""
    write_corpus(workdir / "text.txt")
    common = [*TINY_GPT, "trainer.max_steps=2", "trainer.test=false", "optimizer=adamw",
              "trainer.log_every_n_steps=1", *GRADS,
              # A stalled rank is named with its stack (the watchdog) and the sweep's own
              # timeout comes before pytest's, with the output: a hang reads as a message.
              "trainer.dist_timeout_s=60"]
    two, four = ["trainer.procs=2", "data.batch_size=8"], ["trainer.procs=4", "data.batch_size=4"]
    common.append("+callbacks.model_state._target_=ddpexp.callbacks.ModelStateSize")
    ac = "trainer.activation_checkpointing=true"
    runs = sweep_cases(workdir, {
        "ddp": ["trainer.strategy=ddp", *two],
        "ddp_ac": ["trainer.strategy=ddp", ac, *two],
        "fsdp_ac": ["trainer.strategy=fsdp", ac, *two],
        "ddp_4": ["trainer.strategy=ddp", *four],
        "fsdp_ac_4": ["trainer.strategy=fsdp", ac, *four],
    }, common, timeout=240)
    reference = grads(runs["ddp"])
    assert "tok.weight" in reference[0]  # the tied weight, once
    for name in ("ddp_ac", "fsdp_ac"):
        assert_close_grads(grads(runs[name]), reference, 1e-6)
    assert_close_grads(grads(runs["fsdp_ac_4"]), grads(runs["ddp_4"]), 1e-6)
    # Model state per rank (parameters, gradients, AdamW's two moments): 16 bytes a
    # parameter under ddp, within 2% of 16/N under fsdp (shards of uneven rows included).
    for name, world in (("ddp", 1), ("fsdp_ac", 2), ("fsdp_ac_4", 4)):
        scalars = read_scalars(runs[name] / "tb")
        n_params = scalars["memory/parameters"][0][1]
        state = scalars["memory/model_state_bytes"][0][1]
        assert 16 * n_params / world <= state <= 1.02 * 16 * n_params / world, (name, state, n_params)
    log = (runs["fsdp_ac"] / "ddpexp.log").read_text()
    assert "fsdp: 2 block(s) and the root of GPT sharded over 2 rank(s)" in log
    assert "activation checkpointing: 2 block(s) of GPT" in log
    # best.pt is one file of whole weights that the plain model loads strictly, tied.
    from ddpexp.models import GPT

    best = torch.load(runs["fsdp_ac_4"] / "checkpoints" / "best.pt", weights_only=True)
    model = GPT(vocab_size=best["model"]["tok.weight"].shape[0], block_size=16, n_layer=2,
                n_head=2, n_embd=32)
    model.load_state_dict(best["model"], strict=True)
    assert model.head.weight is model.tok.weight


def whole_weights(run_dir: Path) -> dict:
    from ddpexp.checkpoint.io import load

    return load(run_dir / "checkpoints" / "last.pt")["model"]


def test_sharded_checkpoints_resume_at_any_world_size(workdir):
    """A 2-worker fsdp run (with the average of the weights and the 2 best epochs kept)
    stopped mid-epoch (step 12 of 20) resumes bit-exactly on 2 workers, and on 1 and 4
    workers with the same global batch (32) continues at the same sample, within 1e-4 of the
    uninterrupted run; ddpexp.eval reads the sharded last.pt and best.pt alike."""
    features = ["trainer.ema_decay=0.9", "trainer.save_top_k=2"]
    common = [*TINY, *features, "trainer.strategy=fsdp", "optimizer=adamw", "trainer.procs=2",
              "data.batch_size=16"]
    runs = sweep_cases(workdir, {"whole": ["trainer.max_steps=20"], "first": ["trainer.max_steps=12"]},
                 common)
    first, whole = runs["first"], runs["whole"]
    m = read_metrics(first)
    assert m["steps"] == 12 and m["epochs"] == 1  # 8 steps an epoch: stopped mid-epoch
    meta = torch.load(first / "checkpoints" / "last.pt" / "meta.pt", weights_only=True)
    assert (meta["epoch"], meta["batch"], meta["global_batch"]) == (1, 4, 32)
    (workdir / "conf").rename(workdir / "conf-first")
    (workdir / "sweep").rename(workdir / "sweep-first")
    first = workdir / "sweep-first" / first.name
    runs = sweep_cases(workdir, {
        "same": ["trainer.procs=2", "data.batch_size=16"],
        "one": ["trainer.procs=1", "data.batch_size=32"],
        "four": ["trainer.procs=4", "data.batch_size=8"],
    }, [*TINY, *features, "trainer.strategy=fsdp", "optimizer=adamw", "trainer.max_steps=20",
        f"resume={first}"])
    whole = workdir / "sweep-first" / whole.name
    expected = read_metrics(whole)
    same = read_metrics(runs["same"])
    assert same["final"] == expected["final"] and same["steps"] == 20
    for name, tensor in whole_weights(whole).items():  # the averaged weights
        assert torch.equal(whole_weights(runs["same"])[name], tensor), name
    top = sorted((runs["same"] / "checkpoints").glob("epoch*.pt"))
    assert len(top) == 2  # whole-weights files of the 2 best epochs
    for path in top:
        assert torch.load(path, weights_only=True)["model"].keys() == whole_weights(whole).keys()
    for name in ("one", "four"):
        got = read_metrics(runs[name])
        assert got["steps"] == 20 and got["world_size"] == {"one": 1, "four": 4}[name]
        assert got["final"]["val/loss"] == pytest.approx(expected["final"]["val/loss"], rel=1e-4)
    log = (runs["four"] / "ddpexp.log").read_text()
    assert "checkpoint written by 2 workers, resumed on 4" in log

    res = run_cli([str(runs["four"] / "checkpoints" / "last.pt"), "split=val", "trainer.procs=2"],
                  workdir, module="ddpexp.eval")
    row = next(line.split() for line in res.stdout.splitlines() if line.startswith(runs["four"].name + " "))
    assert float(row[3]) == pytest.approx(read_metrics(runs["four"])["final"]["val/loss"], abs=1e-4)


def test_killed_fsdp_worker_ends_the_run_naming_its_rank(workdir):
    started = time.time()
    res = run_cli([*TINY, "trainer.strategy=fsdp", "trainer.procs=2", "model._target_=faulty.Faulty",
                   "+model.mode=kill"], workdir, env=plugins_env(), expect_ok=False, timeout=90)
    assert res.returncode != 0 and time.time() - started < 60
    assert "was killed by SIGKILL" in res.stderr or "rank 1 was killed by a signal" in res.stderr, res.stderr
    assert read_metrics(only_run_dir(workdir))["status"] == "failed"
