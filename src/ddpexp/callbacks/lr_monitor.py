"""``callbacks.lr_monitor``: the learning rate each optimizer step used, as ``train/lr``
(and ``train/lr_group<i>`` for further parameter groups), every ``every_n_steps`` steps."""

from __future__ import annotations

from ddpexp.callbacks.base import Callback, TrainerView
from ddpexp.errors import ConfigError


class LearningRateMonitor(Callback):
    """Logs the lr of every parameter group, read just before the step uses it."""

    def __init__(self, every_n_steps: int = 1, name: str = "train/lr"):
        if int(every_n_steps) < 1:
            raise ConfigError(f"callbacks.lr_monitor.every_n_steps={every_n_steps} must be >= 1")
        self.every, self.name = int(every_n_steps), name

    def on_before_optimizer_step(self, trainer: TrainerView) -> None:
        # trainer.step counts the steps done; this one is step + 1, as it is logged.
        if trainer.is_main and (trainer.step + 1) % self.every == 0:
            groups = trainer.optimizer.param_groups
            values = {self.name: groups[0]["lr"]}
            for i, group in enumerate(groups[1:], start=1):
                values[f"{self.name}_group{i}"] = group["lr"]
            trainer.log_metrics(values, step=trainer.step + 1)
