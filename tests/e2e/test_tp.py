"""Tensor parallelism (``trainer.tp``) with real gloo processes: the char GPT's losses at
tp=2, and at fsdp x tp on a 2x2 mesh, equal one worker's with the same global batch; its
DCP checkpoints resume bit-exactly on the same mesh and reshard to one worker, to fsdp, and
from ddp; ``ddpexp.eval`` reads them; a layout that cannot run is one message."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_GPT,
    assert_close_grads,
    read_metrics,
    run_cli,
    sweep_cases,
    write_corpus,
)

from ddpexp.checkpoint.sharded import is_sharded

pytestmark = pytest.mark.slow

# The char GPT (2 heads: one per rank at tp=2), no dropout, AdamW, a loss every step.
COMMON = [*(o for o in TINY_GPT if not o.startswith("model.dropout")), "model.dropout=0",
          "optimizer=adamw", "trainer.log_every_n_steps=1", "logger=csv", "trainer.test=false",
          "trainer.max_epochs=3", "trainer.dist_timeout_s=60"]
# The same global batch (8) in every layout: data.batch_size is per data-parallel rank.
ONE = ["trainer.procs=1", "data.batch_size=8"]
TP2 = ["trainer.procs=2", "trainer.tp=2", "data.batch_size=8"]  # dp=1 x tp=2
TP2_DP2 = ["trainer.procs=4", "trainer.tp=2", "data.batch_size=4"]  # ddp: dp=2 x tp=2
GRID = ["trainer.procs=4", "trainer.strategy=fsdp", "trainer.tp=2", "data.batch_size=4"]  # 2x2
# What a run keeps besides last.pt, as under fsdp: an average of the weights, the 2 best
# epochs' files, digests, written in the background; epochs of 8 steps.
KEEP = ["trainer.ema_decay=0.9", "trainer.save_top_k=2", "trainer.async_save=true",
        "trainer.limit_train_batches=8"]
DDP2 = ["trainer.procs=2", "trainer.strategy=ddp", "data.batch_size=4"]
FSDP2 = ["trainer.procs=2", "trainer.strategy=fsdp", "trainer.tp=1", "data.batch_size=4"]


def losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["name"] == "train/loss"]


def whole_weights(run_dir: Path) -> dict:
    from ddpexp.checkpoint.io import load

    return load(run_dir / "checkpoints" / "last.pt")["model"]


def test_tp_and_fsdp_by_tp_train_as_one_worker(workdir):
    """22 steps of the char GPT at tp=2 (dp=1), at dp=2 x tp=2 (gradients averaged over
    the replicas) and at fsdp dp=2 x tp=2: every step's loss
    within 1e-4 of one worker's, the validation (each sample counted once) too; last.pt is
    DCP shards, best.pt one file of whole weights the plain model loads."""
    write_corpus(workdir / "text.txt")
    runs = sweep_cases(workdir, {"one": ONE, "tp": TP2, "tp_dp": TP2_DP2, "grid": GRID},
                       [*COMMON, "trainer.max_steps=22"], timeout=300)
    reference = losses(runs["one"])
    assert len(reference) == 22
    for name in ("tp", "tp_dp", "grid"):
        got = losses(runs[name])
        assert len(got) == 22
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True))
        assert worst <= 1e-4, (name, worst)
        assert read_metrics(runs[name])["final"]["val/loss"] == pytest.approx(
            read_metrics(runs["one"])["final"]["val/loss"], rel=1e-4)
        assert is_sharded(runs[name] / "checkpoints" / "last.pt")
    assert "2 worker(s): strategy=ddp, dp=1 x tp=2, CPU" in (runs["tp"] / "ddpexp.log").read_text()
    assert "tensor parallel: GPT split over tp=2 rank(s) by its plan, dp=2 replica(s)" in \
        (runs["tp_dp"] / "ddpexp.log").read_text()
    log = (runs["grid"] / "ddpexp.log").read_text()
    assert "4 worker(s): strategy=fsdp, dp=2 x tp=2, CPU" in log
    assert "sharded over 2 rank(s), each a group of tp=2" in log
    from ddpexp.models import GPT

    best = torch.load(runs["grid"] / "checkpoints" / "best.pt", weights_only=True)["model"]
    model = GPT(vocab_size=best["tok.weight"].shape[0], block_size=16, n_layer=2, n_head=2,
                n_embd=32)
    model.load_state_dict(best, strict=True)
    assert model.head.weight is model.tok.weight


def test_a_users_model_with_a_plan_gets_one_workers_clipped_gradients(workdir):
    """A model of the user's own (tests/plugins/tpmodel.py: a plan, no ddpexp code) at tp=2
    and at fsdp 2x2: the first 2 steps' whole gradients, clipped to a total norm of 0.05
    over split and whole layers alike, within 1e-6 of one worker's."""
    common = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
              "data.val_samples=64", "model=mlp", "model._target_=tpmodel.Planned",
              "model.hidden=[16]", "optimizer=adamw", "trainer.grad_clip=0.05",
              "trainer.max_steps=4", "trainer.test=false", "trainer.dist_timeout_s=60",
              "+callbacks.grads._target_=gradprobe.SaveGrads", "+callbacks.grads.path=grads.pt"]
    runs = sweep_cases(workdir, {
        "one": ["trainer.procs=1", "data.batch_size=16"],
        "tp": ["trainer.procs=2", "trainer.tp=2", "data.batch_size=16"],
        "grid": ["trainer.procs=4", "trainer.strategy=fsdp", "trainer.tp=2", "data.batch_size=8"],
    }, common, timeout=240)
    reference = torch.load(runs["one"] / "grads.pt", weights_only=True)
    total = torch.stack([g.norm() for g in reference[0].values()]).norm()
    assert float(total) == pytest.approx(0.05, rel=1e-5)  # clipped
    for name in ("tp", "grid"):
        assert_close_grads(torch.load(runs[name] / "grads.pt", weights_only=True), reference, 1e-6)
    assert "tensor parallel: Planned split over tp=2 rank(s) by its plan" in \
        (runs["tp"] / "ddpexp.log").read_text()


def test_tp_checkpoints_resume_bit_exactly_and_reshard(workdir):
    """Stopped at step 12 (mid-epoch) and resumed to step 20: tp=2 -> tp=2 is bit-exact
    against the uninterrupted run; tp=2 -> one worker, tp=2 -> fsdp dp=2, fsdp 2x2 -> fsdp
    dp=2 and ddp -> tp=2 each continue at the same sample (within 1e-4), saying they
    resharded; ddpexp.eval reads the tp checkpoint on one worker and on its own mesh. With
    an average of the weights, the top 2 epochs kept and saves in the background."""
    write_corpus(workdir / "text.txt")
    runs = sweep_cases(workdir, {
        "whole": [*TP2, "trainer.max_steps=20"], "tp": [*TP2, "trainer.max_steps=12"],
        "grid": [*GRID, "trainer.max_steps=12"], "ddp": [*DDP2, "trainer.max_steps=12"],
    }, [*COMMON, *KEEP], timeout=300)
    assert read_metrics(runs["tp"])["epochs"] == 1  # stopped mid-epoch (step 4 of 8)
    (workdir / "conf").rename(workdir / "conf-first")
    (workdir / "sweep").rename(workdir / "sweep-first")
    first = {name: workdir / "sweep-first" / run.name for name, run in runs.items()}
    resumed = sweep_cases(workdir, {
        "same": [*TP2, f"resume={first['tp']}"],
        "one": [*ONE, "trainer.tp=1", f"resume={first['tp']}"],
        "tp_fsdp": [*FSDP2, f"resume={first['tp']}"],
        "grid_fsdp": [*FSDP2, f"resume={first['grid']}"],
        "ddp_tp": [*TP2, f"resume={first['ddp']}"],
    }, [*COMMON, *KEEP, "trainer.max_steps=20"], timeout=300)
    whole = read_metrics(first["whole"])
    same = read_metrics(resumed["same"])
    assert same["steps"] == 20 and same["final"] == whole["final"]
    expected = whole_weights(first["whole"])
    got = whole_weights(resumed["same"])
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():  # the averaged weights
        assert torch.equal(got[name], tensor), name
    kept = resumed["same"] / "checkpoints"
    assert (kept / "last.pt" / "SHA256SUMS").is_file() and (kept / "best.pt.sha256").is_file()
    top = sorted(kept.glob("epoch*.pt"))
    assert len(top) == 2  # whole-weights files of the 2 best epochs
    for path in top:
        assert torch.load(path, weights_only=True)["model"].keys() == expected.keys()
    lines = {
        "one": "strategy=ddp dp=1 x tp=2, this run is strategy=single dp=1 x tp=1",
        "tp_fsdp": "strategy=ddp dp=1 x tp=2, this run is strategy=fsdp dp=2 x tp=1",
        "grid_fsdp": "strategy=fsdp dp=2 x tp=2, this run is strategy=fsdp dp=2 x tp=1",
        "ddp_tp": "strategy=ddp dp=2 x tp=1, this run is strategy=ddp dp=1 x tp=2",
    }
    for name, line in lines.items():
        m = read_metrics(resumed[name])
        assert m["status"] == "completed" and m["steps"] == 20, (name, m)
        assert m["final"]["val/loss"] == pytest.approx(whole["final"]["val/loss"], rel=1e-4), name
        assert f"resharded: the checkpoint was written at {line}" in \
            (resumed[name] / "ddpexp.log").read_text()
    assert "resharded" not in (resumed["same"] / "ddpexp.log").read_text()

    last = first["tp"] / "checkpoints" / "last.pt"
    val = read_metrics(first["tp"])["final"]["val/loss"]
    for layout in (["trainer.procs=1", "trainer.tp=1"], []):  # one worker; the run's own tp=2
        res = run_cli([str(last), "split=val", *layout], workdir, module="ddpexp.eval")
        row = next(line.split() for line in res.stdout.splitlines()
                   if line.startswith(first["tp"].name + " "))
        assert float(row[3]) == pytest.approx(val, abs=1e-4), layout
        assert row[-1] == ("1" if layout else "2")


@pytest.mark.parametrize("overrides,message", [
    ([*COMMON, "trainer.procs=2", "trainer.tp=3"],
     "trainer.tp=3 does not divide the world size 2 (trainer.procs=2 x trainer.nodes=1)"),
    (["data=synthetic", "model=mlp", "trainer.procs=2", "trainer.tp=2"],
     "trainer.tp=2: MLP has no tensor-parallel plan. Give it a method ddpexp_tp_plan(self, tp)"),
])
def test_a_layout_tp_cannot_run_is_one_message_before_training(workdir, overrides, message):
    write_corpus(workdir / "text.txt")
    res = run_cli(overrides, workdir, expect_ok=False, timeout=60)
    text = res.stdout + res.stderr
    assert res.returncode != 0 and message in text, text
    assert "Traceback" not in text and text.count(message) == 1, text
    # Nothing trained: no step ran anywhere.
    for path in workdir.glob("outputs/**/metrics.json"):
        assert read_metrics(path.parent)["steps"] == 0
