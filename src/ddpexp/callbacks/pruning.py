"""``callbacks.pruning``: the ``optuna_async`` search's pruning, from inside a trial.

Only active in a trial's run (see :mod:`ddpexp.pruning`). After each validation global rank
0 reports the monitored value to the study and asks the pruner; the answer reaches every
rank in one small broadcast, and a pruned trial stops after that epoch's checkpoint with
status ``pruned``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from ddpexp import pruning
from ddpexp.callbacks.base import Callback



class OptunaPruning(Callback):
    """Reports each validation of an ``optuna_async`` trial; off outside a trial."""

    def __init__(self) -> None:
        self.enabled = pruning.in_trial()
        self.reporter: Any = None

    def setup(self, trainer: "Trainer") -> None:
        self.reporter = pruning.from_env() if trainer.is_main else None

    def on_validation_end(self, trainer: "Trainer", metrics: Mapping[str, float]) -> None:
        value = float(metrics[trainer.monitor])
        flag = torch.zeros(1, dtype=torch.int32, device=trainer.device)
        if self.reporter is not None:
            flag[0] = int(self.reporter.should_prune(trainer.epoch, value))
        if trainer.world_size > 1:
            dist.broadcast(flag, src=0)
        if flag.item():
            trainer.request_stop(f"pruned by the search after epoch {trainer.epoch} "
                                 f"({trainer.monitor} {value:.4f})", status="pruned")
