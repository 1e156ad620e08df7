"""What every strategy does, as ``single`` does it: the default of each step a strategy
may change, and the torch modes a run executes under."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpexp.checkpoint import io as ckpt_io
from ddpexp.config.schema import Strategy, TrainerConfig
from ddpexp.runtime.dist import DistContext
from ddpexp.strategies.blocks import checkpoint_activations, find_blocks

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
