"""A checkpoint's weights evaluated by a running trainer: the test of ``best.pt`` after
training, and ``python -m ddpexp.eval``. Rank 0 reads the file and broadcasts the weights,
so ranks on other nodes need no shared file system; every rank evaluates its unpadded shard,
each sample counted once."""

from __future__ import annotations

import logging
from collections.abc import Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from ddpexp.callbacks.base import TrainerView
from ddpexp.checkpoint import io as ckpt_io
from ddpexp.checkpoint import sharded as ckpt_sharded
from ddpexp.errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from ddpexp.callbacks.checkpoint import ModelCheckpoint
    from ddpexp.data.base import DataSource
    from ddpexp.strategies.base import Strategy

log = logging.getLogger("ddpexp")


class Evaluable(TrainerView, Protocol):
    """What an evaluation reads of the trainer (:class:`ddpexp.training.trainer.Trainer`)
    beyond what callbacks see. A protocol, not the trainer's class: the trainer imports this
    module, and this one states what it needs instead of importing the trainer."""

    data: DataSource
    val_ds: Dataset
    test_ds: Dataset | None
    strategy: Strategy
    evaluated_samples: int  # set by each evaluate()

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The run's checkpoint callback (where best.pt is), None without one."""
        ...

    def eval_loader(self, dataset: Dataset) -> Any:
        """This rank's unpadded shard of ``dataset``."""
        ...

    def evaluate(self, loader: Any, prefix: str = "val") -> dict[str, float]:
        """The task's metrics over the split behind ``loader``, as ``prefix/<name>``."""
        ...


def evaluate_checkpoint(trainer: Evaluable, path: Path, split: str = "test") -> dict | None:
    """The task's metrics of checkpoint ``path``'s weights on ``split`` (``test`` or
    ``val``): ``{"metrics": {split/<name>: ..}, "epoch": the epoch those weights ended,
    "samples": n evaluated}``, or ``None`` where rank 0 finds no such file. The trainer's
    model is left holding those weights. Every rank must call it."""
    dataset = {"test": trainer.test_ds, "val": trainer.val_ds}[split]
    if dataset is None or len(dataset) == 0:
        raise ConfigError(f"data={type(trainer.data).__name__} has no {split} split; "
                          "evaluate split=val, or give the data a test split")
    epoch = torch.tensor([-1], dtype=torch.long, device=trainer.device)
    weights = None
    if trainer.is_main and (Path(path).is_file() or ckpt_sharded.is_sharded(path)):
        state = ckpt_io.load(path, map_location="cpu")
        weights = state["model"]
        # The epoch whose weights these are: the last validated one when it was saved.
        history = state.get("history") or [{"epoch": max(0, state.get("epoch", 1) - 1)}]
        epoch.fill_(int(history[-1]["epoch"]))
    if trainer.world_size > 1:
        dist.broadcast(epoch, src=0)
    if int(epoch) < 0:
        return None
    trainer.strategy.load_full_weights(trainer.module, weights)
    # The weights just loaded are the ones to evaluate (with EMA, the averaged ones of that
    # checkpoint), not the run's current average.
    values = trainer.evaluate(trainer.eval_loader(dataset), split)
    return {"metrics": values, "epoch": int(epoch), "samples": trainer.evaluated_samples}


def evaluate_best(trainer: Evaluable) -> dict | None:
    """Evaluate ``best.pt`` (the monitored best, not the last weights; where the run's
    checkpoint callback put it) on the test split and log ``test/<name>``; the trainer keeps
    its last weights. Returns what :func:`evaluate_checkpoint` does, or None without a test
    split, a checkpoint callback or a best.pt."""
    if trainer.test_ds is None or len(cast(Sized, trainer.test_ds)) == 0:
        if trainer.is_main:
            log.info("no test split in data=%s: test skipped", type(trainer.data).__name__)
        return None
    saver = trainer.checkpoint_callback
    if saver is None:
        if trainer.is_main:
            log.info("no checkpoint callback (~callbacks.checkpoint), so no best.pt: test skipped")
        return None
    best = saver.best_model_path
    if trainer.is_main and not best.is_file():
        log.warning("%s does not exist: test skipped", best)
    last = trainer.strategy.snapshot(trainer.module)
    result = evaluate_checkpoint(trainer, best, "test")
    trainer.module.load_state_dict(last)
    if result is not None and trainer.is_main:
        trainer.log_metrics(result["metrics"])
        shown = "  ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items())
        log.info("test (best.pt, epoch %d, %d samples)  %s", result["epoch"], result["samples"], shown)
    return result
