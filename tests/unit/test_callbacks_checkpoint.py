"""The checkpoint callback's files through fits of a few steps (callbacks/checkpoint.py):
last.pt every N steps, best.pt, the top-k files."""

from __future__ import annotations

import pytest
import torch

from ddpexp.callbacks import ModelCheckpoint
from ddpexp.errors import ConfigError


def test_arguments_checked():
    with pytest.raises(ConfigError, match=r"callbacks.checkpoint.every_n_steps=0 must be >= 1 \(or null\)"):
        ModelCheckpoint(every_n_steps=0)


def test_every_n_steps_saves_mid_epoch(trainer_factory):
    steps = []

    class Watch(ModelCheckpoint):
        def save(self, trainer, best=False, ranked=None):
            super().save(trainer, best, ranked)
            trainer.wait_for_saves()  # written in the background (trainer.async_save)
            saved = torch.load(self.dirpath / "last.pt", weights_only=True)
            steps.append((saved["step"], saved["epoch"], saved["batch"]))

    trainer_factory(samples=(48, 8, 0), callbacks={"checkpoint": Watch(every_n_steps=2)}).fit()
    # 6 batches: mid-epoch at steps 2 and 4 (resume point: epoch 0, that batch), end at 6
    assert steps == [(2, 0, 2), (4, 0, 4), (6, 1, 0)]


def test_top_k_files_follow_ranking(trainer_factory):
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(save_top_k=2)}, max_epochs=4,
                        samples=(32, 16, 0))
    result = t.fit()
    ckpt = t.run_dir / "checkpoints"
    saved = torch.load(ckpt / "last.pt", weights_only=True)
    kept = saved["callbacks"]["checkpoint"]["top_k"]["kept"]
    assert len(kept) == 2
    files = sorted(p.name for p in ckpt.glob("epoch*.pt"))
    assert files == sorted(e["name"] for e in kept)
    accs = sorted((h["val/acc"] for h in result["history"]), reverse=True)
    assert [e["value"] for e in kept] == accs[:2]
    best = torch.load(ckpt / "best.pt", weights_only=True)
    assert best["history"][-1]["val/acc"] == accs[0]
