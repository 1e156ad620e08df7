"""``callbacks.ema``: an exponential moving average of the weights
(``trainer.ema_decay``), used for validation, the test, ``best.pt`` and the sweep's value.

It runs first at every event: the average is updated right after each optimizer step,
swapped into the model for each validation (and back afterwards), and it is what a
checkpoint's ``"model"`` holds (the trained weights go under ``"raw_model"``), so that
``best.pt`` is the averaged model that was validated.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from ddpexp.callbacks.base import EARLY, Callback
from ddpexp.ema import EMA as Average
from ddpexp.errors import ConfigError


log = logging.getLogger("ddpexp")


class EMA(Callback):
    """``decay`` in [0, 1) (e.g. 0.999); ``None`` leaves it off."""

    order = EARLY

    def __init__(self, decay: Optional[float] = None):
        if decay is not None and not 0.0 <= float(decay) < 1.0:
            raise ConfigError(f"trainer.ema_decay={decay} must be in [0, 1) (e.g. 0.999), or null")
        self.decay = decay
        self.enabled = decay is not None
        self.average: Optional[Average] = None
        self._applied: Any = None
        self._restart = False

    def setup(self, trainer: "Trainer") -> None:
        # The average follows the unwrapped model's own tensors; DDP keeps them identical
        # on every rank, so every rank's average is identical without communication.
        self.average = Average(trainer.module, float(self.decay))

    def on_fit_start(self, trainer: "Trainer") -> None:
        if self._restart:  # resumed from weights without an average: start it at them
            self.average = Average(trainer.module, float(self.decay))

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        self.average.update()

    def on_validation_start(self, trainer: "Trainer") -> None:
        self._applied = self.average.applied()
        self._applied.__enter__()

    def on_validation_end(self, trainer: "Trainer", metrics: Mapping[str, float]) -> None:
        applied, self._applied = self._applied, None
        if applied is not None:
            applied.__exit__(None, None, None)

    def on_exception(self, trainer: "Trainer", exc: BaseException) -> None:
        self.on_validation_end(trainer, {})  # a validation cut short: trained weights back

    def on_save_checkpoint(self, trainer: "Trainer", checkpoint: dict) -> None:
        checkpoint["raw_model"] = checkpoint["model"]
        checkpoint["model"] = self.average.averaged()
        checkpoint["ema"] = {"decay": self.average.decay, "updates": self.average.updates}

    def on_load_checkpoint(self, trainer: "Trainer", checkpoint: dict) -> None:
        if "raw_model" not in checkpoint:
            self._restart = True
            return
        self.average.load_state_dict({"averaged": checkpoint["model"],
                                      "updates": checkpoint["ema"]["updates"]})
        checkpoint["model"] = checkpoint.pop("raw_model")  # what the trainer loads
