"""How the workers of a run share the model (``trainer.strategy``): what wraps it, how a
micro-batch skips the gradient sync, how gradients are clipped and measured, which batches
an evaluation runs, and how the model's and the optimizer's state are gathered, saved and
loaded. The trainer, the checkpoint callback and the evaluation ask their strategy and
branch on none of them.

``single`` and ``dp`` (``nn.DataParallel`` over a node's GPUs, one process) need no sync
between processes; ``ddp`` wraps the model in ``DistributedDataParallel``; ``fsdp`` shards
the parameters, gradients and optimizer state over the ranks (:class:`FSDP`). Also the
torch modes a run executes under (:func:`debug_modes`).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, ContextManager, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddpexp import checkpoint as ckpt_io
from ddpexp.blocks import checkpoint_activations, find_blocks
from ddpexp.config import Strategy, TrainerConfig
from ddpexp.dist import DistContext
from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")


class Local:
    """One process holds the whole model (``single``, ``dp``)."""

    # Whether each rank holds only shards of the model's state (every rank then takes part
    # in writing a checkpoint).
    sharded = False

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        self.t, self.ctx = t, ctx

    def checkpoint_activations(self, module: nn.Module) -> None:
        """``trainer.activation_checkpointing``: each block recomputed in backward."""
        if self.t.activation_checkpointing:
            n = checkpoint_activations(module, find_blocks(module, self.t.fsdp.wrap))
            if self.ctx.is_main:
                log.info("activation checkpointing: %d block(s) of %s recomputed in backward",
                         n, type(module).__name__)

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

    def grad_norm(self, params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
        """The total gradient norm over all ranks' gradients (None without gradients)."""
        grads = [p.grad for p in params if p.grad is not None]
        return nn.utils.get_total_norm(grads) if grads else None

    def all_finite(self, module: nn.Module) -> bool:
        """Whether every weight is finite (the same verdict on every rank)."""
        return all(bool(torch.isfinite(p).all()) for p in module.parameters())

    def eval_batches(self, loader: Any) -> Iterator[tuple[Any, bool]]:
        """(batch, counted) for an evaluation over ``loader``, this rank's shard."""
        for batch in loader:
            yield batch, True

    # -------------------------------------------------------------- state
    def model_state(self, module: nn.Module) -> dict:
        """The state dict a checkpoint's ``"model"`` holds, as this strategy saves it."""
        return module.state_dict()

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def save(self, state: Optional[dict], last: Path, copies: Sequence[Path] = ()) -> None:
        """Write ``state`` (from :func:`ddpexp.state.gather`: rank 0's dict, None elsewhere)
        as ``last`` and one-file ``copies`` of it (best.pt, top-k). Every rank calls it."""
        if state is None:
            return
        ckpt_io.save_atomic(state, last)
        for path in copies:
            ckpt_io.copy_atomic(last, path)

    def read_sharded(self, module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
        """The sharded checkpoint at ``path``, whole tensors (every rank reads it)."""
        return ckpt_io.load_sharded(path, keys=ckpt_io.SHARDED_KEYS)

    def from_file(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """A checkpoint file's dict in this strategy's form (whole tensors, as it is here)."""
        return state

    def load_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        """Give ``optimizer`` a saved state: ``optimizer.state_dict()``'s form, or the form
        keyed by parameter name that sharded checkpoints hold."""
        if _by_name(saved):
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(module, optimizer, saved)
        else:
            optimizer.load_state_dict(saved)

    def load_full_weights(self, module: nn.Module, weights: Optional[Mapping[str, torch.Tensor]]) -> None:
        """Load whole ``weights`` that global rank 0 read (None elsewhere) into every rank's
        model. Every rank calls it."""
        if weights is not None:
            module.load_state_dict(weights)
        if self.ctx.world_size > 1:
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0)

    def snapshot(self, module: nn.Module) -> dict:
        """A copy of the model's weights to put back with ``module.load_state_dict``."""
        return {k: v.to("cpu", copy=True) for k, v in module.state_dict().items()}


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


class FSDP(DDP):
    """Fully sharded data parallel (FSDP2, ``fully_shard``): each block of the model
    (:mod:`ddpexp.blocks`) is sharded as a unit, then the root, so each rank keeps
    1/world of the parameters, gradients and optimizer state, and gathers one unit's
    parameters at a time for its forward and backward.

    A checkpoint's ``last`` is a sharded directory that each rank writes its shards into;
    best.pt and the top-k files are one file each, the whole weights gathered to rank 0.
    """

    sharded = True

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        super().__init__(t, ctx)
        if str(t.precision) == "16":
            raise ConfigError("trainer.precision=16 (fp16 with a gradient scaler) is not supported "
                              "with trainer.strategy=fsdp; use trainer.precision=bf16")
        self.blocks: list[nn.Module] = []
        release_freed_memory()

    def checkpoint_activations(self, module: nn.Module) -> None:
        self.blocks = find_blocks(module, self.t.fsdp.wrap)
        super().checkpoint_activations(module)

    def wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        f = self.t.fsdp
        if not self.blocks:
            self.blocks = find_blocks(module, f.wrap)
        tied, kind = _tied_names(module), type(module).__name__
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
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

    def no_sync(self, model: nn.Module, sync: bool) -> ContextManager[Any]:
        # FSDP2 has no no_sync(): a micro-batch that is not the step's last keeps its
        # unsharded gradients and skips the reduce-scatter.
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return _whole(nn.utils.clip_grad_norm_(list(params), max_norm))

    def grad_norm(self, params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
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
        for n, batch in enumerate(loader, start=1):
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

    def save(self, state: Optional[dict], last: Path, copies: Sequence[Path] = ()) -> None:
        assert state is not None  # every rank gathers its shards
        tensors = {k: state.pop(k) for k in ckpt_io.SHARDED_KEYS if k in state}
        ckpt_io.save_sharded(tensors, state if self.ctx.is_main else None, last, self.ctx.is_main)
        if copies:
            whole = self._gather(tensors["model"])
            if whole is not None:
                single = {**state, "model": whole}
                ckpt_io.save_atomic(single, copies[0])
                for path in copies[1:]:
                    ckpt_io.copy_atomic(copies[0], path)

    def read_sharded(self, module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
        # Read into this run's own shards: the checkpoint is resharded to this world size.
        stored = sharded_shapes(path)
        template: dict[str, Any] = {
            key: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for key in ("model", "raw_model") if key in stored}
        template["optimizer"] = self.optimizer_state(module, optimizer)
        return ckpt_io.load_sharded(path, template=template)

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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        whole = not any(isinstance(v, DTensor) for s in saved["state"].values() for v in s.values())
        set_optimizer_state_dict(module, optimizer, saved,
                                 options=StateDictOptions(full_state_dict=whole))

    def _gather(self, weights: Mapping[str, torch.Tensor]) -> Optional[dict]:
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

    def load_full_weights(self, module: nn.Module, weights: Optional[Mapping[str, torch.Tensor]]) -> None:
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


def sharded_shapes(path: Path) -> dict[str, dict[str, torch.Size]]:
    """The tensors a sharded checkpoint holds, by entry: {"model": {name: global shape}}."""
    import torch.distributed.checkpoint as dcp

    out: dict[str, dict[str, torch.Size]] = {}
    for fqn, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        entry, _, name = fqn.partition(".")
        if hasattr(meta, "size"):
            out.setdefault(entry, {})[name] = meta.size
    return out


def _whole(norm: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _shard_like(value: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as ``live`` (this rank's shard of a DTensor), without
    communication: every rank holds the whole one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(live, DTensor):
        return value
    return distribute_tensor(value.to(live.device), live.device_mesh, live.placements,
                             src_data_rank=None)


def _by_name(saved: Mapping[str, Any]) -> bool:
    """Whether an optimizer state is keyed by parameter name (sharded checkpoints)."""
    groups = saved.get("param_groups") or []
    return bool(groups) and any(isinstance(p, str) for g in groups for p in g["params"])


def _optimizer_by_name(module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """``optimizer.state_dict()``'s form (parameters by index) keyed by parameter name, for
    a strategy that shards it; the indices follow ``optimizer``'s parameters."""
    if _by_name(saved):
        return saved
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": {names[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in saved["param_groups"]]}


def _tied_names(module: nn.Module) -> list[list[str]]:
    """Names of the parameters registered under more than one name, one list per tensor."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def for_config(t: TrainerConfig, ctx: DistContext) -> Local:
    """The strategy of ``trainer.strategy`` (``auto`` is resolved by the launcher)."""
    if t.strategy is Strategy.fsdp:
        return FSDP(t, ctx)
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
