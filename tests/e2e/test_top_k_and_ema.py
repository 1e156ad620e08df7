"""trainer.save_top_k and trainer.ema_decay in real runs: the k best checkpoints on disk and
through a resume; the averaged weights in validation, best.pt and the checkpoint; exact
resume with them, in one process and under DDP."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_same_tensors, build_trainer, read_metrics, run_cli, run_dirs

# Small and noisy, with dropout (the RNG matters) and a schedule (its state matters).
ARGS = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "scheduler=step", "scheduler.step_size=1",
    "scheduler.gamma=0.5", "trainer.log_every_n_steps=2",
]


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _top_k_name(entry: dict, metric: str) -> str:
    return f"epoch{entry['epoch']:03d}-{metric.replace('/', '_')}-{entry[metric]:.6g}.pt"


def test_save_top_k_keeps_the_two_best_through_a_resume(tmp_path):
    args = [*ARGS, "trainer.save_top_k=2", "trainer.monitor=val/loss", "optimizer.lr=0.1"]
    ckpts = tmp_path / "checkpoints"
    first = build_trainer(tmp_path, [*args, "trainer.max_epochs=2"]).fit()
    assert len(list(ckpts.glob("epoch*.pt"))) == 2
    assert len(_load(ckpts / "last.pt")["callbacks"]["checkpoint"]["top_k"]["kept"]) == 2  # the ranking is in the checkpoint
    result = build_trainer(tmp_path, [*args, "trainer.max_epochs=5"]).fit(resume_from=ckpts / "last.pt")
    assert len(result["history"]) == 5 and result["history"][:2] == first["history"]
    best_two = sorted(result["history"], key=lambda h: h["val/loss"])[:2]
    kept = sorted(p.name for p in ckpts.glob("epoch*.pt"))
    assert kept == sorted(_top_k_name(h, "val/loss") for h in best_two)
    for entry in best_two:  # each file is that epoch's checkpoint
        ckpt = _load(ckpts / _top_k_name(entry, "val/loss"))
        assert ckpt["history"][-1] == entry
    files = {*kept, "last.pt", "best.pt"}
    assert {p.name for p in ckpts.iterdir()} == {*files, *(f"{f}.sha256" for f in files)}


def test_ema_decay_zero_is_the_same_run_as_no_ema(tmp_path):
    plain = build_trainer(tmp_path / "plain", [*ARGS, "trainer.max_epochs=2"]).fit()
    zero = build_trainer(tmp_path / "zero", [*ARGS, "trainer.max_epochs=2", "trainer.ema_decay=0"]).fit()
    assert zero["history"] == plain["history"]
    a = _load(tmp_path / "plain/checkpoints/last.pt")
    b = _load(tmp_path / "zero/checkpoints/last.pt")
    assert_same_tensors(b["model"], a["model"], "model")
    assert_same_tensors(b["raw_model"], a["model"], "raw_model")
    assert_same_tensors(b["optimizer"], a["optimizer"], "optimizer")


def test_ema_weights_are_validated_and_are_what_best_pt_holds(tmp_path):
    result = build_trainer(tmp_path / "ema", [*ARGS, "trainer.max_epochs=3", "trainer.ema_decay=0.9"]).fit()
    best = _load(tmp_path / "ema/checkpoints/best.pt")
    assert best["ema"]["decay"] == 0.9 and best["ema"]["updates"] == best["step"]
    weight = next(k for k, v in best["model"].items() if v.is_floating_point())
    assert not torch.equal(best["model"][weight], best["raw_model"][weight])
    # A trainer without EMA, given best.pt's "model", validates to the best value logged.
    fresh = build_trainer(tmp_path / "fresh", ARGS)
    fresh.module.load_state_dict(best["model"])
    monitor = result["monitor"]
    assert fresh.evaluate(fresh.val_loader, "val")[monitor] == pytest.approx(result["best"][monitor], abs=1e-12)
    # The test split was evaluated with best.pt's averaged weights too.
    test = fresh.evaluate(fresh.eval_loader(fresh.test_ds), "test")
    assert result["test"]["test/loss"] == pytest.approx(test["test/loss"], abs=1e-12)
    # ... and the raw weights do not (the averaged ones are what was validated).
    fresh.module.load_state_dict(best["raw_model"])
    assert fresh.evaluate(fresh.val_loader, "val")["val/loss"] != best["metrics"]["val/loss"]


def test_ema_resume_is_bit_exact(tmp_path):
    args = [*ARGS, "trainer.max_epochs=3", "trainer.ema_decay=0.8"]
    build_trainer(tmp_path / "whole", args).fit()
    stopped = tmp_path / "stopped"
    build_trainer(stopped, [*args, "trainer.max_steps=17"]).fit()  # mid-epoch 1
    assert 0 < _load(stopped / "checkpoints/last.pt")["batch"] < 12
    build_trainer(stopped, args).fit(resume_from=stopped / "checkpoints/last.pt")
    a, b = _load(stopped / "checkpoints/last.pt"), _load(tmp_path / "whole/checkpoints/last.pt")
    for key in ("model", "raw_model", "ema", "optimizer", "scheduler", "step"):
        assert_same_tensors(a[key], b[key], key)


@pytest.mark.slow
def test_ema_and_top_k_resume_exactly_under_ddp(workdir):
    """A top-k file is a checkpoint to resume from: the run continued from the one of epoch 0
    ends bit-identical to the run that wrote it, averaged weights, ranking and all."""
    args = [*ARGS, "trainer.procs=2", "trainer.max_epochs=3", "trainer.ema_decay=0.8",
            "trainer.save_top_k=3", "trainer.monitor=val/loss"]
    run_cli(args, workdir, timeout=150)
    (whole,) = run_dirs(workdir / "outputs")
    (first,) = (whole / "checkpoints").glob("epoch000-*.pt")
    assert _load(first)["world_size"] == 2 and len(_load(first)["ranks"]) == 2
    again = workdir / "again" / "checkpoints"
    again.mkdir(parents=True)
    shutil.copy(first, again / "last.pt")
    shutil.copy(first, again / first.name)  # the ranking in it names this file
    run_cli([*args, f"resume={again.parent}"], workdir, timeout=150)
    a, b = _load(again / "last.pt"), _load(whole / "checkpoints/last.pt")
    for key in ("model", "raw_model", "ema", "optimizer", "step", "callbacks", "history"):
        assert_same_tensors(a[key], b[key], key)
    names = lambda d: sorted(p.name for p in (d / "checkpoints").glob("epoch*.pt"))
    assert names(again.parent) == names(whole) and len(names(whole)) == 3
    assert read_metrics(again.parent)["best"] == read_metrics(whole)["best"]
