"""``trainer.strategy=fsdp``: FSDP2 (``fully_shard``) per block, then the root."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpexp.config.schema import TrainerConfig
from ddpexp.errors import ConfigError
from ddpexp.runtime.dist import DP, DistContext
from ddpexp.strategies.blocks import find_blocks
from ddpexp.strategies.sharded import Sharded, tied_names
from ddpexp.strategies.tp import apply_plan

log = logging.getLogger("ddpexp")


class FSDP(Sharded):
    """Fully sharded data parallel (FSDP2, ``fully_shard``): each block of the model
    (:mod:`ddpexp.strategies.blocks`) is sharded as a unit, then the root, so each rank keeps
    1/dp of the parameters, gradients and optimizer state, and gathers one unit's
    parameters at a time for its forward and backward. With ``trainer.tp > 1`` the model is
    first split by its tensor-parallel plan inside each group of ``tp`` ranks
    (:mod:`ddpexp.strategies.tp`), then sharded over the data-parallel dimension: a 2-D mesh.
    Checkpoints: :class:`~ddpexp.strategies.sharded.Sharded`.
    """

    name = "fsdp"
    # FSDP2 shards only contiguous parameters (channels_last ones are not).
    channels_last = False
    tensor_parallel = "ddpexp.strategies.fsdp.FSDP"  # itself: the 2-D mesh

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        super().__init__(t, ctx)
        self.blocks: list[nn.Module] = []
        release_freed_memory()

    def checkpoint_activations(self, module: nn.Module) -> None:
        self.blocks = find_blocks(module, self.t.blocks)
        super().checkpoint_activations(module)

    def wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        f = self.t.fsdp  # this strategy's own settings (trainer.fsdp.*)
        if not self.blocks:
            self.blocks = find_blocks(module, self.t.blocks)
        if self.t.tp > 1:
            apply_plan(module, self.ctx, self.t.tp)
            # The plan's last layer hands back its gathered output as a view of the DTensor's
            # local tensor, and FSDP2 warns each rank of in-place ops on a view; the loop's
            # loss takes the logits as they are.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        tied, kind = tied_names(module), type(module).__name__
        # FSDP shards over the data-parallel dimension of the run's mesh.
        mesh = self.ctx.mesh[DP] if self.ctx.mesh is not None else \
            init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": f.reshard_after_forward}
        if str(self.t.precision) == "bf16":
            # bf16 compute and all-gathers, fp32 gradient reduction and fp32 master weights.
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if f.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        if "mp_policy" in kw:
            # BatchNorm's kernels want its weights in the dtype of its fp32 running statistics:
            # each BatchNorm is a unit of its own that keeps fp32 parameters (autocast still
            # runs the convolutions around it in bf16).
            for norm in [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
                fully_shard(norm, **{**kw, "mp_policy": MixedPrecisionPolicy()})
        for block in self.blocks:
            fully_shard(block, **kw)
        fully_shard(module, **kw)
        for names in tied:  # one parameter under several names stays one parameter
            owners = {id(module.get_parameter(n)) for n in names}
            if len(owners) != 1:
                raise ConfigError(f"sharding untied the shared weight {', '.join(names)}: put "
                                  "the modules that share it in the same unit (trainer.fsdp.wrap)")
        if self.ctx.is_main:
            log.info("fsdp: %d block(s) and the root of %s sharded over %d rank(s)%s",
                     len(self.blocks), kind, self.ctx.dp_size,
                     f", each a group of tp={self.t.tp}" if self.t.tp > 1 else "")
        return module

    def no_sync(self, model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        # FSDP2 has no no_sync(): a micro-batch that is not the step's last keeps its
        # unsharded gradients and skips the reduce-scatter.
        model.set_requires_gradient_sync(sync)  # pyright: ignore[reportCallIssue]  # FSDPModule's method, not Module's
        return contextlib.nullcontext()

    def eval_batches(self, loader: Any) -> Iterator[tuple[Any, bool]]:
        # Each forward gathers every unit's parameters from all ranks, so every rank runs
        # as many forwards as the rank with the most batches; a rank whose shard is shorter
        # repeats its last batch, uncounted.
        most = torch.tensor([len(loader)], device=self.ctx.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        last = None
        n = 0
        for batch in loader:
            n += 1
            last = batch
            yield batch, True
        if n < int(most) and last is None:
            raise ConfigError("an evaluation split with fewer samples than workers cannot run "
                              "under trainer.strategy=fsdp; use fewer workers")
        for _ in range(int(most) - n):
            yield last, False

# glibc's mallopt parameter: allocations of at least this many bytes get their own mapping.
_M_MMAP_THRESHOLD = -3


def release_freed_memory(threshold: int = 1 << 20) -> bool:
    """Have glibc's allocator give memory back to the system as soon as it is freed, for
    allocations of ``threshold`` bytes and more (their own mappings). Sharding frees whole
    parameters and gathers and frees each unit's parameters and gradients at every step; by
    default glibc raises its threshold to the size of what was freed (up to 32 MiB) and then
    serves those sizes from its heap, which keeps the freed pages: on the CPU that was 0.5 GB
    more resident memory per rank for the 151M-parameter GPT. A no-op (False) without glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


