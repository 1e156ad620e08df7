"""``trainer.strategy=ddp``: one replica per process, gradients all-reduced in buckets."""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from ddpexp.strategies.base import Local

log = logging.getLogger("ddpexp")


class DDP(Local):
    """One model replica per process, gradients all-reduced in buckets."""

    name = "ddp"
    spans_processes = True
    # trainer.tp > 1: the model split inside each tensor-parallel group, gradients averaged
    # over the data-parallel replicas.
    tensor_parallel = "ddpexp.strategies.tp.TensorParallel"

    def prepare(self, module: nn.Module) -> nn.Module:
        if self.t.sync_batchnorm and self.ctx.device.type != "cpu":
            return nn.SyncBatchNorm.convert_sync_batchnorm(module)
        return super().prepare(module)

    def wrap(self, module: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device = self.ctx.device
        ids = [device.index] if device.type == "cuda" else None
        # Gradients as views into DDP's all-reduce buckets: no copy of every gradient into
        # its bucket and back each step (3-4% of a step of the overhead benchmark's MLP on
        # the CPU), and one copy of the gradients fewer in memory.
        return DistributedDataParallel(module, device_ids=ids,
                                       find_unused_parameters=self.t.find_unused_parameters,
                                       gradient_as_bucket_view=True)

    def no_sync(self, model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if sync else model.no_sync()  # pyright: ignore[reportCallIssue]  # DDP's method
