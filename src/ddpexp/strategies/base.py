"""What every strategy answers and does (:class:`Strategy`), ``single`` (:class:`Local`),
and the torch modes a run executes under."""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import sharded as ckpt_sharded
from ddpexp.config.schema import TrainerConfig
from ddpexp.runtime.dist import DistContext
from ddpexp.strategies.blocks import checkpoint_activations, find_blocks

log = logging.getLogger("ddpexp")


class Strategy(ABC):
    """How the workers of a run share the model: what the launching process asks before any
    process group exists (class attributes), and what each step of a rank does (methods,
    whose defaults hold for a strategy that keeps the whole model on every rank).

    ``trainer.strategy`` names a subclass by its registered name
    (:mod:`ddpexp.strategies.registry`) or by its dotted path; it is built as
    ``cls(trainer_config, dist_context)``.
    """

    #: The name ``trainer.strategy`` registers it under ("" for a class named by its path).
    name: ClassVar[str] = ""
    #: Whether it runs as one process per rank in a process group (set up even for one
    #: process); False: one process in all, and no process group.
    spans_processes: ClassVar[bool] = True
    #: Whether its one process drives every GPU of ``trainer.gpus`` on one node.
    one_process: ClassVar[bool] = False
    #: Whether each rank holds only shards of the model's state: every rank then takes part
    #: in writing a checkpoint, and ``last`` is a sharded directory rather than one file.
    sharded: ClassVar[bool] = False
    #: Whether :meth:`save` runs no collective, so that ``trainer.async_save`` may run it in
    #: a background thread while the loop goes on (False: every save stays in the loop).
    background_save: ClassVar[bool] = True
    #: Whether :meth:`start_save` writes a checkpoint in the background though :meth:`save`
    #: runs collectives (fsdp: every rank its shards, with DCP's async save).
    staged_save: ClassVar[bool] = False
    #: Whether the model's parameters may be laid out channels_last (``trainer.channels_last``).
    channels_last: ClassVar[bool] = True
    #: Whether its forward and backward run collectives (fsdp gathers each block's
    #: parameters): a rank that fails inside them leaves the others waiting in one.
    collective_forward: ClassVar[bool] = False
    #: The dotted path of the strategy that runs this one's runs at ``trainer.tp > 1`` (see
    #: :func:`ddpexp.strategies.registry.tensor_parallel_class`); None: it cannot.
    tensor_parallel: ClassVar[str | None] = None

    def __init__(self, t: TrainerConfig, ctx: DistContext):
        self.t, self.ctx = t, ctx

    @classmethod
    def label(cls) -> str:
        """The strategy as messages name it: its registered name, or its class's path."""
        return vars(cls).get("name") or f"{cls.__module__}.{cls.__qualname__}"

    @property
    def dp_rank(self) -> int:
        """This rank's place among the replicas that train on different data (its shard of
        each split): the context's data-parallel rank."""
        return self.ctx.dp_rank

    @property
    def dp_size(self) -> int:
        """How many replicas train on different data (the shards each split is cut into): the
        context's data-parallel size."""
        return self.ctx.dp_size

    def checkpoint_activations(self, module: nn.Module) -> None:
        """``trainer.activation_checkpointing``: each block recomputed in backward."""
        if self.t.activation_checkpointing:
            n = checkpoint_activations(module, find_blocks(module, self.t.blocks))
            if self.ctx.is_main:
                log.info("activation checkpointing: %d block(s) of %s recomputed in backward",
                         n, type(module).__name__)

    def prepare(self, module: nn.Module) -> nn.Module:
        """``module`` (already on the device) ready to be wrapped: SyncBatchNorm where asked
        and where it has something to do."""
        return module

    @abstractmethod
    def wrap(self, module: nn.Module) -> nn.Module:
        """The model the training step calls."""

    def no_sync(self, model: nn.Module, sync: bool) -> AbstractContextManager[Any]:
        """The context of a micro-batch's forward and backward; ``sync`` is False for all but
        the last micro-batch of an optimizer step."""
        return contextlib.nullcontext()

    def clip(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the total gradient norm to ``max_norm``; return the norm before clipping."""
        return nn.utils.clip_grad_norm_(params, max_norm)

    def grad_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
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

    def save(self, state: dict | None, last: Path, copies: Sequence[Path] = ()) -> None:
        """Write ``state`` (from :func:`ddpexp.training.checkpoint_state.gather`: rank 0's dict, None elsewhere)
        as ``last`` and one-file ``copies`` of it (best.pt, top-k). Every rank calls it."""
        if state is None:
            return
        ckpt_files.save_atomic(state, last)
        for path in copies:
            ckpt_files.copy_atomic(last, path)

    def start_save(self, state: dict | None, last: Path, copies: Sequence[Path] = (),
                   before_write: Callable[[], None] | None = None,
                   staging: ckpt_sharded.HostStaging | None = None) -> Callable[[], None]:
        """Where :attr:`staged_save`: begin :meth:`save` in the loop's thread, every rank at
        the same point (copying the state to host memory and running what collectives stay
        in the loop), and return what completes it in a background thread."""
        raise NotImplementedError(f"{self.label()} writes its checkpoints with save()")

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (where :attr:`staged_save`, a collective)."""
        return flag

    def read_sharded(self, module: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
        """The sharded checkpoint at ``path``, whole tensors (every rank reads it)."""
        return ckpt_sharded.load_sharded(path, keys=ckpt_sharded.SHARDED_KEYS)

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

    def load_full_weights(self, module: nn.Module, weights: Mapping[str, torch.Tensor] | None) -> None:
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


class Local(Strategy):
    """``single``: one process holds the whole model."""

    name = "single"
    spans_processes = False

    def prepare(self, module: nn.Module) -> nn.Module:
        if self.t.sync_batchnorm and self.ctx.is_main:
            # torch's SyncBatchNorm has no CPU kernel (config.validate refuses CPU DDP with it);
            # one process has nothing to synchronise, so there it is ignored.
            log.warning("trainer.sync_batchnorm ignored: one process (strategy=%s, %s) has "
                        "no BatchNorm statistics to synchronise", self.label(),
                        self.ctx.device.type)
        return super().prepare(module)

    def wrap(self, module: nn.Module) -> nn.Module:
        return module


def _whole(norm: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


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
