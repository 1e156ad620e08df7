"""A user callback (plugged in with ``+callbacks.grads=...``) that records the whole
gradients of the first ``steps`` optimizer steps, as the optimizer is about to see them
(after clipping), so that runs under different strategies can be compared."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ddpexp import Callback


class SaveGrads(Callback):
    def __init__(self, path: str, steps: int = 2):
        self.path, self.steps = path, steps
        self.grads: list[dict] = []

    def on_before_optimizer_step(self, trainer) -> None:
        if trainer.step >= self.steps:
            return
        step = {}
        for name, p in trainer.module.named_parameters():
            g = p.grad
            g = g.full_tensor() if isinstance(g, DTensor) else g  # a collective under fsdp
            step[name] = g.detach().to("cpu", copy=True)
        self.grads.append(step)
        if trainer.is_main and len(self.grads) == self.steps:
            torch.save(self.grads, trainer.run_dir / self.path)  # relative to the run dir
