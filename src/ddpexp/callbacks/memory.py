"""``callbacks.model_state`` (opt in: ``+callbacks.model_state._target_=ddpexp.callbacks.ModelStateSize``):
the bytes of model state each rank holds, counted exactly at the second optimizer step (the
first whose optimizer state exists): its parameters, their gradients and the optimizer's
state, the local shards only under ``strategy=fsdp``.

Logged once, by rank 0, as ``memory/model_state_bytes`` (the largest rank's),
``memory/model_state_bytes_min`` (the smallest rank's) and ``memory/parameters`` (the
model's parameter count, each shared tensor once), so that the per-rank figure can be
compared with 16 bytes per parameter (fp32 AdamW) divided by the number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpexp.callbacks.base import Callback, TrainerView


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's shard on this rank
    return to_local() if to_local is not None else t


def _bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


class ModelStateSize(Callback):
    """Counts this rank's parameter, gradient and optimizer-state bytes once."""

    def __init__(self, at_step: int = 1):
        self.at_step = int(at_step)

    def on_before_optimizer_step(self, trainer: TrainerView) -> None:
        if trainer.step != self.at_step:
            return
        params = {id(p): p for p in trainer.module.parameters()}.values()
        total = sum(_bytes(p) for p in params)
        total += sum(_bytes(p.grad) for p in params if p.grad is not None)
        for state in trainer.optimizer.state.values():
            total += sum(_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        count = sum(p.numel() for p in params)  # a DTensor's numel is the whole tensor's
        sizes = torch.tensor([total, -total], dtype=torch.float64, device=trainer.device)
        if trainer.world_size > 1:
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        trainer.log_metrics({"memory/model_state_bytes": float(sizes[0]),
                             "memory/model_state_bytes_min": -float(sizes[1]),
                             "memory/parameters": float(count)}, step=trainer.step + 1)
