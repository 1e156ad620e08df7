"""How the workers of a run share the model (``trainer.strategy``): what wraps it, how a
micro-batch skips the gradient sync, how gradients are clipped and measured, which batches
an evaluation runs, and how the model's and the optimizer's state are gathered, saved and
loaded. The trainer, the checkpoint callback and the evaluation ask their strategy and
branch on none of them.

``single`` and ``dp`` (``nn.DataParallel`` over a node's GPUs, one process) need no sync
between processes; ``ddp`` wraps the model in ``DistributedDataParallel``; ``fsdp`` shards
the parameters, gradients and optimizer state over the ranks (:class:`FSDP`). Also the
torch modes a run executes under (:func:`debug_modes`) and the blocks a model is sharded and
checkpointed by (:mod:`~ddpexp.strategies.blocks`). The process group they run in is set up
by :mod:`ddpexp.runtime.dist`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpexp import lazy_attributes

if TYPE_CHECKING:
    from ddpexp.config.schema import TrainerConfig
    from ddpexp.runtime.dist import DistContext
    from ddpexp.strategies.base import Local

__getattr__, __dir__ = lazy_attributes(__name__, {
    "Local": "ddpexp.strategies.base",
    "debug_modes": "ddpexp.strategies.base",
    "DDP": "ddpexp.strategies.ddp",
    "FSDP": "ddpexp.strategies.fsdp",
    "release_freed_memory": "ddpexp.strategies.fsdp",
    "sharded_shapes": "ddpexp.strategies.fsdp",
})


def for_config(t: TrainerConfig, ctx: DistContext) -> Local:
    """The strategy of ``trainer.strategy`` (``auto`` is resolved by the launcher)."""
    from ddpexp.config.schema import Strategy
    from ddpexp.strategies.base import Local
    from ddpexp.strategies.ddp import DDP
    from ddpexp.strategies.fsdp import FSDP

    if t.strategy is Strategy.fsdp:
        return FSDP(t, ctx)
    return DDP(t, ctx) if t.strategy is Strategy.ddp else Local(t, ctx)
