"""``trainer.strategy=fsdp``: FSDP2 (``fully_shard``) per block, then the root."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import sharded as ckpt_sharded
from ddpexp.checkpoint.background import snapshot
from ddpexp.config.schema import TrainerConfig
from ddpexp.errors import ConfigError
from ddpexp.runtime.dist import DP, DistContext
from ddpexp.strategies.base import _optimizer_by_name, _whole
from ddpexp.strategies.blocks import find_blocks
from ddpexp.strategies.ddp import DDP

log = logging.getLogger("ddpexp")


class FSDP(DDP):
    """Fully sharded data parallel (FSDP2, ``fully_shard``): each block of the model
    (:mod:`ddpexp.strategies.blocks`) is sharded as a unit, then the root, so each rank keeps
    1/world of the parameters, gradients and optimizer state, and gathers one unit's
    parameters at a time for its forward and backward.

    A checkpoint's ``last`` is a sharded directory that each rank writes its shards into;
    best.pt and the top-k files are one file each, the whole weights gathered to rank 0.
    Under ``trainer.async_save`` (:meth:`start_save`) the shards are written by DCP's async
    save; the gather of best.pt's weights, a collective on the loop's process group, stays in
    the loop, and rank 0 writes the gathered copy in the background.
    """

    name = "fsdp"
    sharded = True
    # Every rank writes its shards, and gathering best.pt's weights is a collective: save()
    # stays in the loop, and trainer.async_save runs start_save() instead.
    background_save = False
    staged_save = True
    # FSDP2 shards only contiguous parameters (channels_last ones are not).
    channels_last = False
    collective_forward = True

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        super().__init__(t, ctx)
        if str(t.precision) == "16":
            raise ConfigError("trainer.precision=16 (fp16 with a gradient scaler) is not supported "
                              "with trainer.strategy=fsdp; use trainer.precision=bf16")
        self.blocks: list[nn.Module] = []
        self._save_group: Any = None  # the process group of DCP's background writes
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
        tied, kind = _tied_names(module), type(module).__name__
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
            log.info("fsdp: %d block(s) and the root of %s sharded over %d rank(s)",
                     len(self.blocks), kind, self.ctx.world_size)
        return module

    def no_sync(self, model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        # FSDP2 has no no_sync(): a micro-batch that is not the step's last keeps its
        # unsharded gradients and skips the reduce-scatter.
        model.set_requires_gradient_sync(sync)  # pyright: ignore[reportCallIssue]  # FSDPModule's method, not Module's
        return contextlib.nullcontext()

    def clip(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return _whole(nn.utils.clip_grad_norm_(list(params), max_norm))

    def grad_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        norm = super().grad_norm(params)
        return None if norm is None else _whole(norm)

    def all_finite(self, module: nn.Module) -> bool:
        from torch.distributed.tensor import DTensor

        finite = all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                     for p in module.parameters())
        flag = torch.tensor([int(finite)], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

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

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer)

    def save(self, state: dict | None, last: Path, copies: Sequence[Path] = ()) -> None:
        assert state is not None  # every rank gathers its shards
        tensors = {k: state.pop(k) for k in ckpt_sharded.SHARDED_KEYS if k in state}
        ckpt_sharded.save_sharded(tensors, state if self.ctx.is_main else None, last, self.ctx.is_main)
        if copies:
            whole = self._gather(tensors["model"])
            if whole is not None:
                single = {**state, "model": whole}
                ckpt_files.save_atomic(single, copies[0])
                for path in copies[1:]:
                    ckpt_files.copy_atomic(copies[0], path)

    def start_save(self, state: dict | None, last: Path, copies: Sequence[Path] = (),
                   before_write: Callable[[], None] | None = None,
                   staging: ckpt_sharded.HostStaging | None = None) -> Callable[[], None]:
        """:meth:`save` in the background: this rank's shards copied to host memory and
        written by ``torch.distributed.checkpoint.async_save`` over a gloo group of the
        writers' own (created at the first save, every rank at the same point), so that its
        collectives, in DCP's thread, never race the loop's on the default group. best.pt's
        and the top-k files' whole weights are gathered here, in the loop (a collective on
        the default group); rank 0 writes them once the shards are in place. ``staging``:
        the host buffers of the last save, which the shards are copied into where they
        fit. Returns what
        completes the save (:func:`ddpexp.checkpoint.sharded.start_sharded`), for the writer's
        thread."""
        assert state is not None  # every rank gathers its shards
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        tensors = {k: state.pop(k) for k in ckpt_sharded.SHARDED_KEYS if k in state}
        meta = snapshot(state) if self.ctx.is_main else None  # the rest: small, copied here
        complete = ckpt_sharded.start_sharded(tensors, meta, last, self.ctx.is_main,
                                         self._save_group, before_write, staging)
        whole = self._gather(tensors["model"]) if copies else None  # fresh CPU copies
        single = {**meta, "model": whole} if whole is not None and meta is not None else None

        def finish() -> None:
            complete()
            if single is not None:
                ckpt_files.save_atomic(single, copies[0])
                for path in copies[1:]:
                    ckpt_files.copy_atomic(copies[0], path)

        return finish

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a collective)."""
        value = torch.tensor([int(flag)], device=self.ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def read_sharded(self, module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
        # Read into this run's own shards: the checkpoint is resharded to this world size.
        stored = ckpt_sharded.sharded_shapes(path)
        template: dict[str, Any] = {
            key: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for key in ("model", "raw_model") if key in stored}
        template["optimizer"] = self.optimizer_state(module, optimizer)
        return ckpt_sharded.load_sharded(path, template=template)

    def from_file(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        # Every rank read the whole file: each keeps its own shards of it.
        live = module.state_dict()
        for key in ("model", "raw_model"):
            if key in state:
                state[key] = {k: _shard_like(v, live[k]) if k in live else v
                              for k, v in state[key].items()}
        if "optimizer" in state:
            state["optimizer"] = _optimizer_by_name(module, optimizer, state["optimizer"])
        return state

    def load_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        whole = not any(isinstance(v, DTensor) for s in saved["state"].values() for v in s.values())
        set_optimizer_state_dict(module, optimizer, saved,
                                 options=StateDictOptions(full_state_dict=whole))

    def _gather(self, weights: Mapping[str, torch.Tensor]) -> dict | None:
        """``weights`` (a ``"model"`` entry of shards) as whole tensors on the CPU, on
        global rank 0 (None elsewhere): one tensor at a time. Every rank calls it."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}  # a tied weight is gathered once
        for name, value in weights.items():
            if id(value) not in done:
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                done[id(value)] = whole.detach().to("cpu", copy=True) if self.ctx.is_main else whole
            out[name] = done[id(value)]
        return out if self.ctx.is_main else None

    def load_full_weights(self, module: nn.Module, weights: Mapping[str, torch.Tensor] | None) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, dict(weights or {}), options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def snapshot(self, module: nn.Module) -> dict:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


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


def _shard_like(value: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as ``live`` (this rank's shard of a DTensor), without
    communication: every rank holds the whole one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(live, DTensor):
        return value
    return distribute_tensor(value.to(live.device), live.device_mesh, live.placements,
                             src_data_rank=None)


def _tied_names(module: nn.Module) -> list[list[str]]:
    """Names of the parameters registered under more than one name, one list per tensor."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]
