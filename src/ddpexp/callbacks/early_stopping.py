"""``callbacks.early_stopping``: stop a run whose monitored metric has not improved for
``patience`` validations (``trainer.early_stop_patience``); status ``early_stopped``.

Its counter is part of every checkpoint, so a resumed run counts on where it stopped. It
runs after the user's callbacks and before the checkpoint at each epoch end: the checkpoint
of an epoch holds the counter that epoch left, and a stop takes effect once that checkpoint is
saved.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, cast

from ddpexp.callbacks.base import LATE, Callback, TrainerView
from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")


class EarlyStopping(Callback):
    """``patience``: validations without a strict improvement of ``monitor`` (default: the
    run's ``trainer.monitor``) before the run stops. ``patience=None`` leaves it off."""

    order = LATE

    def __init__(self, patience: int | None = None, monitor: str | None = None,
                 mode: str | None = None, min_delta: float = 0.0):
        if patience is not None and int(patience) < 1:
            raise ConfigError(f"callbacks.early_stopping.patience={patience} must be >= 1 (or null)")
        if mode not in (None, "min", "max"):
            raise ConfigError(f"callbacks.early_stopping.mode={mode!r} is not one of min, max")
        self.patience, self.monitor, self.mode = patience, monitor, mode
        self.min_delta = float(min_delta)
        self.enabled = patience is not None
        self.best: float | None = None
        self.bad_epochs = 0

    def setup(self, trainer: TrainerView) -> None:
        self.monitor = self.monitor or trainer.monitor
        self.mode = self.mode or trainer.monitor_mode

    def on_train_epoch_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        if self.monitor not in metrics:
            raise ConfigError(f"callbacks.early_stopping.monitor={self.monitor} is not a validation "
                              f"metric of the run ({', '.join(metrics)})")
        value = float(metrics[cast(str, self.monitor)])  # setup() filled it in
        sign = 1.0 if self.mode == "max" else -1.0
        if math.isfinite(value) and (self.best is None
                                     or sign * (value - self.best) > self.min_delta):
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
        if self.bad_epochs >= cast(int, self.patience):  # enabled: a patience is set
            trainer.request_stop(f"early stop: {self.monitor} did not improve for "
                                 f"{self.patience} epochs", status="early_stopped")

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.bad_epochs = state.get("best"), int(state.get("bad_epochs", 0))
