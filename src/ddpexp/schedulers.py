"""Learning-rate schedules the ``scheduler`` config group points at.

Each builder is instantiated with ``_partial_: true`` and called by the trainer as
``builder(optimizer, total_steps=..., steps_per_epoch=...)``. Every schedule is stepped once per
optimizer step; the ``step`` schedule still decays per epoch, by computing the epoch from the
step. Warm-up is linear from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps``.
"""

from __future__ import annotations

import logging
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")


class _Factor:
    """A picklable lr multiplier (LambdaLR saves a callable object's attributes, which keeps
    checkpoints loadable with ``weights_only=True``)."""

    def __init__(self, kind: str, total_steps: int, steps_per_epoch: int, warmup_steps: int,
                 min_ratio: float = 0.0, step_size: int = 1, gamma: float = 0.1):
        self.kind, self.total_steps, self.steps_per_epoch = kind, total_steps, steps_per_epoch
        self.warmup_steps, self.min_ratio = warmup_steps, min_ratio
        self.step_size, self.gamma = step_size, gamma

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        epoch = step // self.steps_per_epoch
        return self.gamma ** (epoch // self.step_size)


def _check_warmup(warmup_steps: int, total_steps: int) -> int:
    """The warm-up to use. A run shorter than its recipe's warm-up (``debug=fast``,
    ``trainer.limit_train_batches``, a small ``max_steps``) warms up over all but its last
    step instead of failing, so that any recipe can be tried in a few steps."""
    if warmup_steps < 0:
        raise ConfigError(f"scheduler.warmup_steps={warmup_steps} must be >= 0")
    if warmup_steps >= total_steps:
        log.info("scheduler.warmup_steps=%d is not below this run's %d optimizer steps: "
                 "warming up over %d", warmup_steps, total_steps, total_steps - 1)
        return max(0, total_steps - 1)
    return warmup_steps


def cosine(optimizer: Optimizer, total_steps: int, steps_per_epoch: int,
           warmup_steps: int = 0, min_lr: float = 0.0) -> LRScheduler:
    """lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * (s - w) / (T - w))) / 2 after warm-up."""
    warmup_steps = _check_warmup(warmup_steps, total_steps)
    base = optimizer.param_groups[0]["lr"]
    ratio = min_lr / base if base > 0 else 0.0
    return LambdaLR(optimizer, _Factor("cosine", total_steps, steps_per_epoch, warmup_steps, ratio))


def step(optimizer: Optimizer, total_steps: int, steps_per_epoch: int,
         step_size: int = 3, gamma: float = 0.1, warmup_steps: int = 0) -> LRScheduler:
    """lr(s) = lr * gamma ** (epoch(s) // step_size) after warm-up, like StepLR per epoch."""
    warmup_steps = _check_warmup(warmup_steps, total_steps)
    if step_size < 1:
        raise ConfigError(f"scheduler.step_size={step_size} must be >= 1")
    return LambdaLR(
        optimizer,
        _Factor("step", total_steps, steps_per_epoch, warmup_steps, step_size=step_size, gamma=gamma),
    )


def onecycle(optimizer: Optimizer, total_steps: int, steps_per_epoch: int,
             max_lr: float = 0.1, pct_start: float = 0.3, div_factor: float = 25.0,
             final_div_factor: float = 1e4) -> LRScheduler:
    """torch's OneCycleLR (cosine annealing) over the run's optimizer steps."""
    return OneCycleLR(
        optimizer,
        max_lr=max_lr,
        total_steps=total_steps,
        pct_start=pct_start,
        div_factor=div_factor,
        final_div_factor=final_div_factor,
    )
