"""How the workers of a run share the model (``trainer.strategy``): what wraps it, how a
micro-batch skips the gradient sync, how gradients are clipped. The trainer asks its
strategy and branches on none of them.

``single`` and ``dp`` (``nn.DataParallel`` over a node's GPUs, one process) need no sync
between processes; ``ddp`` wraps the model in ``DistributedDataParallel``. Also the torch
modes a run executes under (:func:`debug_modes`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Iterable, Iterator

import torch
from torch import nn

from ddpexp.config import Strategy, TrainerConfig
from ddpexp.dist import DistContext

log = logging.getLogger("ddpexp")


class Local:
    """One process holds the whole model (``single``, ``dp``)."""

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        self.t, self.ctx = t, ctx

    def prepare(self, module: nn.Module) -> nn.Module:
        """``module`` (already on the device) ready to be wrapped: SyncBatchNorm where asked
        and where it has something to do."""
        if self.t.sync_batchnorm and self.ctx.is_main:
            # torch's SyncBatchNorm has no CPU kernel (config.validate refuses CPU DDP with it);
            # one process has nothing to synchronise, so there it is ignored.
            log.warning("trainer.sync_batchnorm ignored: one process (strategy=%s, %s) has "
                        "no BatchNorm statistics to synchronise", self.t.strategy.value,
                        self.ctx.device.type)
        return module

    def wrap(self, module: nn.Module) -> nn.Module:
        """The model the training step calls."""
        if self.t.strategy is Strategy.dp and torch.cuda.device_count() > 1:
            return nn.DataParallel(module)
        return module

    def no_sync(self, model: nn.Module, sync: bool) -> ContextManager[Any]:
        """The context of a micro-batch's forward and backward; ``sync`` is False for all but
        the last micro-batch of an optimizer step."""
        return contextlib.nullcontext()

    def clip(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the total gradient norm to ``max_norm``; return the norm before clipping."""
        return nn.utils.clip_grad_norm_(params, max_norm)


class DDP(Local):
    """One model replica per process, gradients all-reduced in buckets."""

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

    def no_sync(self, model: nn.Module, sync: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if sync else model.no_sync()


def for_config(t: TrainerConfig, ctx: DistContext) -> Local:
    """The strategy of ``trainer.strategy`` (``auto`` is resolved by the launcher)."""
    return DDP(t, ctx) if t.strategy is Strategy.ddp else Local(t, ctx)


@contextlib.contextmanager
def debug_modes(t: TrainerConfig) -> Iterator[None]:
    """trainer.detect_anomaly and trainer.deterministic for the length of a run; torch's
    previous settings come back afterwards (a run in a process of its caller's must not
    leave them on)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        with torch.autograd.set_detect_anomaly(True) if t.detect_anomaly else contextlib.nullcontext():
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
