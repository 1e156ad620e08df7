"""``callbacks.checkpoint``: ``last.pt`` at every epoch end (and every
``trainer.ckpt_every_steps`` steps, and when a signal stops the run), ``best.pt`` when the
monitored metric improved, and with ``save_top_k=K`` the K best epochs' files.

It runs last among the callbacks at each event, so a checkpoint holds the state that every
other callback reached in its epoch. It decides when and where; the trainer writes
(``trainer.save_checkpoint``), which gathers every rank's random state (a collective on every
rank): global rank 0 writes, or under ``strategy=fsdp`` every rank writes its shards of
``last.pt`` (a directory) and rank 0 writes best.pt and the top-k files, whole weights.
Non-finite weights are never written (``trainer.weights_finite``): every rank holds the same
weights and reaches the same verdict, and the run then stops as diverged.

This callback is the one place that knows where a run's checkpoints go (``dirpath``,
``last_model_path``, ``best_model_path``); the test of ``best.pt`` after training reads the
path from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpexp.callbacks.base import LAST, Callback, TrainerView
from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io as ckpt_io
from ddpexp.checkpoint.topk import TopK
from ddpexp.errors import ConfigError
from ddpexp.runtime.signals import Interrupted

log = logging.getLogger("ddpexp")


class ModelCheckpoint(Callback):
    """Writes the run's checkpoints into ``dirpath`` (``run_dir/checkpoints``): the newest
    at ``last_model_path``, the best validation by ``trainer.monitor`` so far at
    ``best_model_path``. Which validation was the best is the trainer's ``state.best``
    (``trainer.improved`` for the latest one), kept with or without this callback, so that
    ``metrics.json`` and a sweep's value do not depend on checkpointing."""

    order = LAST

    def __init__(self, save_top_k: int | None = None, every_n_steps: int | None = None):
        for key, value in (("save_top_k", save_top_k), ("every_n_steps", every_n_steps)):
            if value is not None and int(value) < 1:
                raise ConfigError(f"callbacks.checkpoint.{key}={value} must be >= 1 (or null)")
        self.save_top_k, self.every_n_steps = save_top_k, every_n_steps
        self.top_k: TopK | None = None
        # Relative to the run dir until setup, which binds it to the trainer's.
        self.dirpath: Path = ckpt_io.checkpoint_dir(".")

    @property
    def last_model_path(self) -> Path:
        """The newest checkpoint (under fsdp a directory of shards)."""
        return self.dirpath / ckpt_files.LAST

    @property
    def best_model_path(self) -> Path:
        """The checkpoint of the best validation so far (always one file)."""
        return self.dirpath / ckpt_files.BEST

    def setup(self, trainer: TrainerView) -> None:
        self.dirpath = ckpt_io.checkpoint_dir(trainer.run_dir)
        if self.save_top_k:
            self.top_k = TopK(self.save_top_k, trainer.monitor, trainer.monitor_mode)

    def on_fit_start(self, trainer: TrainerView) -> None:
        if not trainer.is_main:
            return
        removed = ckpt_files.remove_stale_temporaries(self.dirpath)
        if removed:
            log.info("removed %d stale checkpoint temporaries", len(removed))
        if self.top_k is not None and trainer.resumed:
            strays = self.top_k.reconcile(self.dirpath)
            if strays:
                log.warning("trainer.save_top_k: %s in %s are not in the resumed ranking and are "
                            "left alone", ", ".join(strays), self.dirpath)

    def on_train_batch_end(self, trainer: TrainerView) -> None:
        every = self.every_n_steps
        # The epoch's last step is saved at its end, validated; leaving it early saves too.
        if not every or trainer.step % every or trainer.batch >= trainer.batches_per_epoch \
                or trainer.leaving_epoch():
            return
        trainer.agree()  # on divergence first: never checkpoint NaN weights
        if not trainer.diverged:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        ranked = (metrics[trainer.monitor], trainer.epoch) if self.top_k is not None else None
        self.save(trainer, best=trainer.improved, ranked=ranked)

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        # A signal: every rank agreed on it, so every rank takes part in the save.
        if isinstance(exc, Interrupted) and trainer.state.last_saved_step != trainer.step:
            self.save(trainer)

    def save(self, trainer: TrainerView, best: bool = False,
             ranked: tuple[float, int] | None = None) -> None:
        """Every rank contributes its state; rank 0 writes last.pt (under fsdp every rank its
        shards of it), and best.pt and the top-k file of a validation ``ranked`` = (value,
        epoch) that makes the top k. Files that fell out of the top k are deleted, by rank 0,
        only once the new checkpoint is on disk (under ``trainer.async_save``, by the
        writer's thread once its write ends)."""
        if not trainer.weights_finite():
            return
        entry, dropped = None, []
        if self.top_k is not None and ranked is not None:
            entry, dropped = self.top_k.offer(*ranked)  # before the state, which holds it
        copies = ([self.best_model_path] if best else []) + ([self.dirpath / entry] if entry else [])
        # The files that fell out go once the new one is on disk, which under
        # trainer.async_save is after this returns.
        drop = self._remover(dropped) if dropped and trainer.is_main else None
        trainer.save_checkpoint(self.last_model_path, copies, then=drop)

    def _remover(self, names: list[str]) -> Callable[[], None]:
        paths = [self.dirpath / name for name in names]

        def remove() -> None:
            for path in paths:
                ckpt_files.remove(path)  # and its digest

        return remove

    def state_dict(self) -> dict:
        return {"top_k": self.top_k.state_dict() if self.top_k is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.top_k is not None:
            self.top_k.load_state_dict(state.get("top_k"))
