"""Tensor parallelism (``trainer.tp=N``): each group of N ranks on the ``tp`` dimension of the
run's mesh splits the model's large layers between them, by the plan the model declares.

A model declares its plan with a method ``ddpexp_tp_plan(self, tp)`` that returns
``{module name: style}``: ``torch.distributed.tensor.parallel``'s ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel`` or any other ``ParallelStyle``, a name matching
``named_modules()`` names with ``*`` for one level (``"blocks.*.q"``). It may raise
``ValueError`` for a degree it cannot split by (the GPT's heads must divide evenly). The
modules the plan leaves out are kept whole on every rank of a group. Weights a model ties
(one parameter under several names) stay tied where the plan lays them out alike.

With ``trainer.strategy=ddp`` (or ``auto``) the run is :class:`TensorParallel`: the split
model in each group, its gradients averaged over the data-parallel replicas. With
``trainer.strategy=fsdp`` it is a 2-D mesh (:class:`~ddpexp.strategies.fsdp.FSDP`): the split
model then sharded over the data-parallel dimension. Either way the ranks of one group read
the same batch, and the checkpoints are DCP shards that any layout reads back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpexp.errors import ConfigError
from ddpexp.runtime.dist import TP, DistContext
from ddpexp.strategies.sharded import Sharded, tied_names

log = logging.getLogger("ddpexp")

# The method a model declares its plan with.
PLAN_METHOD = "ddpexp_tp_plan"


class TensorParallel(Sharded):
    """``trainer.strategy=ddp trainer.tp=N``: the model split by its plan inside each group of
    N ranks; where there are several groups (data-parallel replicas), each micro-batch that
    ends an optimizer step averages the gradients over them, in one all-reduce per dtype."""

    name = "ddp"
    # A plan's layers hold DTensors, laid out as the plan says, not in a memory format.
    channels_last = False
    tensor_parallel = "ddpexp.strategies.tp.TensorParallel"

    def wrap(self, module: nn.Module) -> nn.Module:
        apply_plan(module, self.ctx, self.t.tp)
        if self.ctx.is_main:
            log.info("tensor parallel: %s split over tp=%d rank(s) by its plan, dp=%d replica(s)",
                     type(module).__name__, self.t.tp, self.ctx.dp_size)
        return module

    def no_sync(self, model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        if sync and self.ctx.dp_size > 1:
            return self._average_after(model)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _average_after(self, model: nn.Module) -> Iterator[None]:
        yield  # the micro-batch's forward and backward
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                     for p in model.parameters() if p.grad is not None]
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            for group in by_dtype.values():
                flat = _flatten_dense_tensors(group)
                dist.all_reduce(flat, group=self.ctx.dp_group)
                flat.div_(self.ctx.dp_size)
                for g, mean in zip(group, _unflatten_dense_tensors(flat, group),
                                   strict=True):
                    g.copy_(mean)


def plan_of(module: nn.Module, tp: int) -> dict[str, Any]:
    """The model's tensor-parallel plan for degree ``tp``, checked: every style a
    ``ParallelStyle``, every name matching a module."""
    from torch.distributed.tensor.parallel import ParallelStyle

    kind = type(module).__name__
    own = getattr(module, PLAN_METHOD, None)
    if not callable(own):
        raise ConfigError(
            f"trainer.tp={tp}: {kind} has no tensor-parallel plan. Give it a method "
            f"{PLAN_METHOD}(self, tp) that returns {{module name: style}}, the styles of "
            "torch.distributed.tensor.parallel (ColwiseParallel() for a layer split by its "
            "outputs, RowwiseParallel() for the layer after it); docs/parallelism.md shows the "
            "GPT's. Or run it without trainer.tp")
    try:
        plan = own(tp)
    except ValueError as exc:
        raise ConfigError(f"trainer.tp={tp}: {exc}") from None
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(f"trainer.tp={tp}: {kind}.{PLAN_METHOD}() returned {plan!r}, not a "
                          "non-empty dict of {module name: ParallelStyle}")
    names = [name.split(".") for name, _ in module.named_modules() if name]
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ConfigError(f"trainer.tp={tp}: {kind}.{PLAN_METHOD}()[{key!r}] is "
                              f"{type(style).__name__}, not a ParallelStyle (ColwiseParallel(), "
                              "RowwiseParallel(), ...)")
        if not any(_matches(str(key).split("."), name) for name in names):
            raise ConfigError(f"trainer.tp={tp}: {kind}.{PLAN_METHOD}() names {key!r}, which "
                              f"matches no module of the model")
    return dict(plan)


def apply_plan(module: nn.Module, ctx: DistContext, tp: int) -> None:
    """Split ``module`` in place by its plan over the ``tp`` dimension of ``ctx``'s mesh, its
    tied weights tied again."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = ctx.mesh
    if mesh is None or TP not in (mesh.mesh_dim_names or ()):
        raise ConfigError(f"trainer.tp={tp} needs a process group of world size divisible by "
                          f"{tp}; this process has {ctx.world_size} rank(s) and no tp dimension")
    plan = plan_of(module, tp)
    tied = tied_names(module)
    parallelize_module(module, mesh[TP], plan)
    for names in tied:
        # Each module's parameter was laid out (replaced) on its own; tie the others to the
        # first, where the plan gave them the same layout.
        first = module.get_parameter(names[0])
        for name in names[1:]:
            other = module.get_parameter(name)
            if other is first:
                continue
            if _layout(first) != _layout(other):
                raise ConfigError(
                    f"trainer.tp={tp}: the plan lays out the shared weight {names[0]} and "
                    f"{name} differently; split the modules that share it alike (the GPT's "
                    "token embedding by rows and its output layer by outputs both shard the "
                    "vocabulary), or leave both out of the plan")
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)


def _layout(value: torch.Tensor) -> tuple | None:
    """A parameter's placements on the mesh; None for a tensor every rank holds whole."""
    from torch.distributed.tensor import DTensor

    return tuple(value.placements) if isinstance(value, DTensor) else None


def _matches(pattern: list[str], name: list[str]) -> bool:
    """Whether a plan's key (dot-separated, ``*`` wildcards) names the module ``name``."""
    from fnmatch import fnmatchcase

    return len(pattern) == len(name) and all(fnmatchcase(n, p) for p, n in zip(pattern, name,
                                                                               strict=True))
