"""``callbacks.progress_bar``: a tqdm bar of each epoch's batches on global rank 0, with the
training loss of the latest log step (``trainer.progress_bar``; null = when stderr is a
terminal)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ddpexp.callbacks.base import Callback, TrainerView


class ProgressBar(Callback):
    """``enabled=None``: on when stderr is a terminal."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.bar: Any = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.is_main:
            from tqdm import tqdm

            self.bar = tqdm(total=trainer.batches_per_epoch, leave=False, dynamic_ncols=True)

    def on_train_epoch_start(self, trainer: TrainerView) -> None:
        if self.bar is not None:
            self.bar.reset(total=trainer.batches_per_epoch)
            self.bar.update(trainer.batch)
            self.bar.set_description(f"epoch {trainer.epoch}")

    def on_train_batch_end(self, trainer: TrainerView) -> None:
        if self.bar is not None:
            self.bar.update(trainer.batch - self.bar.n)
            loss = trainer.logged.get("train/loss")
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def on_fit_end(self, trainer: TrainerView, result: Mapping[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
