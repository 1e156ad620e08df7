"""What the strategies that lay a model's state out across ranks share (fsdp, tensor
parallelism, and both on a 2-D mesh): weights and optimizer state as DTensors, gradient
norms over every rank's part, checkpoints as DCP shards that each rank writes its part of
(:mod:`ddpexp.checkpoint.sharded`) and that any other layout reads back, resharded."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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
from ddpexp.runtime.dist import DistContext
from ddpexp.strategies.base import _optimizer_by_name, _whole
from ddpexp.strategies.ddp import DDP


class Sharded(DDP):
    """A strategy whose ranks each hold a part of the model's state (DTensors). A
    checkpoint's ``last`` is a sharded directory that each rank writes its part into;
    best.pt and the top-k files are one file each, the whole weights gathered to rank 0.
    Under ``trainer.async_save`` (:meth:`start_save`) the shards are written by DCP's async
    save; the gather of best.pt's weights, a collective on the loop's process group, stays in
    the loop, and rank 0 writes the gathered copy in the background."""

    sharded = True
    # Every rank writes its shards, and gathering best.pt's weights is a collective: save()
    # stays in the loop, and trainer.async_save runs start_save() instead.
    background_save = False
    staged_save = True
    # The forward and backward run collectives (gathers of shards, sums of partial outputs).
    collective_forward = True

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        super().__init__(t, ctx)
        if str(t.precision) == "16":
            raise ConfigError(f"trainer.precision=16 (fp16 with a gradient scaler) is not supported "
                              f"with {self.layout()}; use trainer.precision=bf16")
        self._save_group: Any = None  # the process group of DCP's background writes

    def layout(self) -> str:
        """The strategy and its mesh, as messages name them."""
        tp = self.t.tp
        return f"trainer.strategy={self.label()}" + (f" trainer.tp={tp}" if tp > 1 else "")

    def clip(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        params = [p for p in params if p.grad is not None]
        norm = self.grad_norm(params)
        if norm is None:
            return torch.zeros((), device=self.ctx.device)
        for group in _by_mesh(params).values():
            nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def grad_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """The total norm of every rank's part of the gradients: DTensors on the same mesh
        are normed together (a reduction over it); the norms of different meshes, and of
        tensors every rank holds whole, are combined here."""
        groups = _by_mesh([p for p in params if p.grad is not None])
        if not groups:
            return None
        norms = [_whole(nn.utils.get_total_norm([g for p in group if (g := p.grad) is not None]))
                 for group in groups.values()]
        return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()

    def all_finite(self, module: nn.Module) -> bool:
        from torch.distributed.tensor import DTensor

        finite = all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                     for p in module.parameters())
        flag = torch.tensor([int(finite)], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

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
                state[key] = {k: shard_like(v, live[k]) if k in live else v
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



def _by_mesh(params: Sequence[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """``params`` grouped by the mesh their gradients are laid out on (None: whole tensors)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        key = (id(grad.device_mesh), tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return groups


def shard_like(value: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as ``live`` (this rank's shard of a DTensor), without
    communication: every rank holds the whole one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(live, DTensor):
        return value
    return distribute_tensor(value.to(live.device), live.device_mesh, live.placements,
                             src_data_rank=None)




def tied_names(module: nn.Module) -> list[list[str]]:
    """Names of the parameters registered under more than one name, one list per tensor."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]

