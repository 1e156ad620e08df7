"""How the workers of a run share the model (``trainer.strategy``): what wraps it, how a
micro-batch skips the gradient sync, how gradients are clipped and measured, which batches
an evaluation runs, and how the model's and the optimizer's state are gathered, saved and
loaded. The trainer, the checkpoint callback and the evaluation ask their strategy and
branch on none of them.

``trainer.strategy`` names a strategy registered in :mod:`~ddpexp.strategies.registry`
(``single``: one process, ``dp``: ``nn.DataParallel`` over a node's GPUs in one process,
``ddp``: ``DistributedDataParallel``, ``fsdp``: the parameters, gradients and optimizer state
sharded over the ranks, :class:`FSDP`) or a user's own :class:`Strategy` subclass by its
dotted path or ``_target_``. Callers ask the strategy's class what it needs (a process group,
one process only, sharded state, channels_last) and never compare its name. Also the torch
modes a run executes under (:func:`debug_modes`), the blocks a model is sharded and
checkpointed by (:mod:`~ddpexp.strategies.blocks`). The process group they run in is set
up by :mod:`ddpexp.runtime.dist`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpexp import lazy_attributes
from ddpexp.errors import ConfigError
from ddpexp.strategies.registry import register, strategy_class

if TYPE_CHECKING:
    from ddpexp.config.schema import TrainerConfig
    from ddpexp.runtime.dist import DistContext
    from ddpexp.strategies.base import Strategy

__all__ = ["for_config", "register", "strategy_class"]

__getattr__, __dir__ = lazy_attributes(__name__, {
    "Strategy": "ddpexp.strategies.base",
    "Local": "ddpexp.strategies.base",
    "debug_modes": "ddpexp.strategies.base",
    "DataParallel": "ddpexp.strategies.dp",
    "DDP": "ddpexp.strategies.ddp",
    "FSDP": "ddpexp.strategies.fsdp",
    "TensorParallel": "ddpexp.strategies.tp",
    "release_freed_memory": "ddpexp.strategies.fsdp",
})


def for_config(t: TrainerConfig, ctx: DistContext) -> Strategy:
    """The strategy of ``trainer.strategy`` (``auto`` is resolved by the launcher): a
    registered name's class, or the class a dotted path or ``_target_`` names."""
    from ddpexp.strategies.registry import kwargs_of, tensor_parallel_class

    cls = strategy_class(t.strategy, ctx.world_size)
    if t.tp > 1:
        tp_cls = tensor_parallel_class(cls)
        if tp_cls is None:
            raise ConfigError(f"trainer.strategy={cls.label()} cannot split the model by tensor "
                              f"parallelism (trainer.tp={t.tp}); use trainer.strategy=ddp or fsdp")
        cls = tp_cls
    return cls(t, ctx, **kwargs_of(t.strategy))
