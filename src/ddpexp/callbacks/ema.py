"""``callbacks.ema``: an exponential moving average of the weights
(``trainer.ema_decay``), used for validation, the test, ``best.pt`` and the sweep's value.

It runs first at every event: the average is updated right after each optimizer step,
swapped into the model for each validation (and back afterwards), and it is what a
checkpoint's ``"model"`` holds (the trained weights go under ``"raw_model"``), so that
``best.pt`` is the averaged model that was validated.

The average itself (:class:`WeightAverage`):
After every optimizer step :meth:`WeightAverage.update` moves each averaged parameter towards the
live one, ``avg = decay * avg + (1 - decay) * param``, in one fused ``torch._foreach_lerp_``
over all parameters (no per-tensor Python loop, no host sync). Buffers (BatchNorm running
statistics, counters) are not averaged: they are copied, as timm's and Composer's EMA do, so
the averaged model is complete and evaluates like any other.

Under DDP every rank holds the same parameters after each step, and the update is a
deterministic function of them, so the average is identical on every rank without any
communication.

The average is a state dict shaped like the model's (:meth:`WeightAverage.averaged`), so a checkpoint
can store it as its ``"model"`` entry and ``model.load_state_dict`` still works on it.
:meth:`WeightAverage.applied` puts it into the model for an evaluation and puts the trained weights
back afterwards.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from ddpexp.callbacks.base import EARLY, Callback, TrainerView
from ddpexp.config.validate import check_ema_decay

log = logging.getLogger("ddpexp")

class WeightAverage:
    """The moving average of ``module``'s parameters (and a copy of its buffers).

    ``decay`` in ``[0, 1)``: 0 keeps an exact copy of the latest weights (the same as no
    EMA), 0.999 averages over roughly the last 1,000 steps.
    """

    def __init__(self, module: nn.Module, decay: float):
        self.decay = float(decay)
        self.updates = 0
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        slot_of: dict[int, tuple[bool, int]] = {}  # id(live tensor) -> (averaged?, index)
        self._slots: dict[str, tuple[bool, int]] = {}  # state-dict name -> its slot
        # keep_vars=True gives the live tensors; tied weights (one tensor under two names) are
        # averaged once and share one averaged tensor, as they share one in the model.
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) not in slot_of:
                averaged = isinstance(tensor, nn.Parameter) and tensor.is_floating_point()
                group = params if averaged else buffers
                slot_of[id(tensor)] = (averaged, len(group))
                group.append(tensor.detach())
            self._slots[name] = slot_of[id(tensor)]
        self._live_params, self._live_buffers = params, buffers
        self._avg_params = [p.clone() for p in params]
        self._avg_buffers = [b.clone() for b in buffers]
        # Under FSDP the parameters are DTensors, which torch's fused list ops do not take:
        # the average of each shard is the shard of the average, so they run on the shards.
        self._sharded = any(hasattr(p, "to_local") for p in params)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the module's current weights into the average (call after optimizer.step)."""
        if self._avg_params:
            avg, live = self._avg_params, self._live_params
            if self._sharded:
                avg, live = _shards(avg), _shards(live)
            if self.decay == 0.0:
                # lerp with weight 1 is not bit-exactly a copy in floating point; decay 0
                # promises exactly the live weights.
                torch._foreach_copy_(avg, live)
            else:
                torch._foreach_lerp_(avg, live, 1.0 - self.decay)
        if self._avg_buffers:
            torch._foreach_copy_(self._avg_buffers, self._live_buffers)
        self.updates += 1

    def averaged(self) -> dict[str, torch.Tensor]:
        """The averaged weights as a state dict with the module's keys (tied names share a
        tensor): what ``module.load_state_dict`` takes."""
        return {name: (self._avg_params if averaged else self._avg_buffers)[i]
                for name, (averaged, i) in self._slots.items()}

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Evaluate with the averaged weights: they are copied into the module for the body
        and the trained weights (and buffers) are copied back afterwards, even on error."""
        live = self._live_params + self._live_buffers
        with torch.no_grad():
            saved = [t.clone() for t in live]
            torch._foreach_copy_(_shards(live), _shards(self._avg_params + self._avg_buffers))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(_shards(live), _shards(saved))

    def state_dict(self) -> dict:
        """What an exact resume needs: the averaged tensors (by module key), decay and the
        number of updates so far."""
        return {"decay": self.decay, "updates": self.updates, "averaged": self.averaged()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (the decay of this run's config is kept)."""
        averaged = state["averaged"]
        missing = sorted(set(self._slots) - set(averaged))
        if missing:
            raise KeyError(f"EMA state lacks {', '.join(missing[:5])}")
        for name, target in self.averaged().items():
            target.copy_(averaged[name])
        self.updates = int(state["updates"])


def _shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (the tensor itself for any other), for the fused list ops."""
    # A DTensor (fsdp) has to_local(); a plain tensor is its own shard.
    return [cast(Any, t).to_local() if hasattr(t, "to_local") else t for t in tensors]

class EMA(Callback):
    """``decay`` in [0, 1) (e.g. 0.999); ``None`` leaves it off."""

    order = EARLY

    def __init__(self, decay: float | None = None):
        check_ema_decay(decay)
        self.decay = decay
        self.enabled = decay is not None
        self.average: WeightAverage | None = None
        self._applied: Any = None
        self._restart = False

    def _average(self) -> WeightAverage:
        if self.average is None:  # setup() builds it; an enabled EMA gets no event before
            raise RuntimeError("callbacks.ema: the average was used before setup()")
        return self.average

    def setup(self, trainer: TrainerView) -> None:
        # The average follows the unwrapped model's own tensors; DDP keeps them identical
        # on every rank, so every rank's average is identical without communication.
        self.average = WeightAverage(trainer.module, float(cast(float, self.decay)))

    def on_fit_start(self, trainer: TrainerView) -> None:
        if self._restart:  # resumed from weights without an average: start it at them
            self.average = WeightAverage(trainer.module, float(cast(float, self.decay)))

    def on_train_batch_end(self, trainer: TrainerView) -> None:
        self._average().update()

    def on_validation_start(self, trainer: TrainerView) -> None:
        self._applied = self._average().applied()
        self._applied.__enter__()

    def on_validation_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        applied, self._applied = self._applied, None
        if applied is not None:
            applied.__exit__(None, None, None)

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self.on_validation_end(trainer, {})  # a validation cut short: trained weights back

    def on_save_checkpoint(self, trainer: TrainerView, checkpoint: dict) -> None:
        checkpoint["raw_model"] = checkpoint["model"]
        checkpoint["model"] = self._average().averaged()
        checkpoint["ema"] = {"decay": self._average().decay, "updates": self._average().updates}

    def on_load_checkpoint(self, trainer: TrainerView, checkpoint: dict) -> None:
        if "raw_model" not in checkpoint:
            self._restart = True
            return
        self._average().load_state_dict({"averaged": checkpoint["model"],
                                      "updates": checkpoint["ema"]["updates"]})
        checkpoint["model"] = checkpoint.pop("raw_model")  # what the trainer loads
