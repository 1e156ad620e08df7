"""The loop's extension seam: :class:`Callback` and the dispatch of its events.

The trainer fires events; callbacks act on them. Every callback runs on every rank (so a
callback may take part in a collective, as long as it does so on every rank at the same
event); what only rank 0 should do, such as writing a file, is gated on ``trainer.is_main``.
A callback's state lives in every checkpoint under ``callbacks/<name>`` and is handed back
on resume, so a resumed run is the uninterrupted one, callbacks included.

Order: callbacks run by ascending :attr:`Callback.order`, then by name. The built-in ones
sit where their work has to be: the average of the weights (EMA) before everything that
evaluates or saves them, user callbacks in the middle, early stopping after them, and the
checkpoint last, so that a checkpoint holds the state every other callback reached in its
epoch (a resume then starts exactly where the run was).

What a callback may use of the running trainer is :class:`TrainerView`, the type of
``trainer`` in every event: the documented surface (docs/callbacks.md), which
:class:`ddpexp.training.trainer.Trainer` implements. Typing the events with it, not with the
trainer's class, lets a type checker hold every callback (the built-in ones included) to that
surface, and keeps this module, which the trainer imports, from importing the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ddpexp.callbacks.state import RunState
    from ddpexp.loggers.collection import Loggers


# The events a callback may implement, in the order a run fires them. The first block is
# the public contract; the second is for callbacks that change what is evaluated or saved.
EVENTS = (
    "setup",
    "on_fit_start",
    "on_train_epoch_start",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_train_epoch_end",
    "on_fit_end",
    "on_exception",
    "on_save_checkpoint",
    "on_load_checkpoint",
)

# Where the built-in callbacks sit (lower runs first); a user's default is USER.
EARLY, USER, LATE, LAST = -100, 0, 100, 1000


class TrainerView(Protocol):
    """What a callback may use of the running trainer (``trainer`` in every event). Read
    everything; change nothing but through the methods (``trainer.state`` is the trainer's
    to change). The last block is for callbacks that save checkpoints or take part in the
    ranks' agreement, as the checkpoint callback does."""

    # -- where this process is
    @property
    def rank(self) -> int:
        """This process's global rank."""
        ...

    @property
    def world_size(self) -> int:
        """The number of processes of the run."""
        ...

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0, the one that writes."""
        ...

    device: torch.device  #: this rank's device
    run_dir: Path  #: the run's directory

    # -- what is trained
    model: nn.Module  #: the model as the strategy wrapped it (DDP, FSDP)
    module: nn.Module  #: the model itself, unwrapped
    optimizer: torch.optim.Optimizer
    monitor: str  #: trainer.monitor, e.g. ``val/acc``
    monitor_mode: str  #: ``max`` or ``min``

    # -- where the run is (read-only)
    @property
    def state(self) -> RunState:
        """The run's counters and record: epoch, batch, step, best, metrics, history,
        status, last_saved_step (:class:`ddpexp.callbacks.state.RunState`)."""
        ...

    @property
    def epoch(self) -> int:
        """The epoch being trained (0-based)."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps done in all."""
        ...

    @property
    def batch(self) -> int:
        """Micro-batches of the current epoch done on this rank."""
        ...

    batches_per_epoch: int  #: the epoch's micro-batches on this rank
    resumed: bool  #: whether the run continues from a checkpoint

    @property
    def improved(self) -> bool:
        """Whether the latest validation was the best so far by ``monitor``."""
        ...

    # -- what it reports
    loggers: Loggers  #: the loggers by name (empty on ranks other than 0)
    logged: dict[str, float]  #: the latest logged training metrics (rank 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """To every logger at ``step`` (default: the current step); rank 0 writes, other
        ranks' calls are no-ops."""
        ...

    def request_stop(self, reason: str, status: str = "stopped") -> None:
        """End the run (from any rank): all ranks stop together at the next agreement point."""
        ...

    # -- for callbacks that save or agree (every rank must call these at the same point)
    def agree(self) -> None:
        """An agreement point: every rank learns of the stops and divergences any rank saw."""
        ...

    @property
    def diverged(self) -> bool:
        """Whether the ranks agreed that training diverged."""
        ...

    def leaving_epoch(self) -> bool:
        """Whether the loop leaves the epoch after this step (a stop, a divergence, the last
        step)."""
        ...

    def weights_finite(self) -> bool:
        """Whether every weight is finite (else the run counts as diverged)."""
        ...

    def save_checkpoint(self, last: Path, copies: Sequence[Path] = (),
                        then: Callable[[], None] | None = None) -> None:
        """Write the checkpoint as of now to ``last`` and copy it to ``copies``, then call
        ``then`` (perhaps later: ``trainer.async_save`` writes in the background)."""
        ...


class Callback:
    """Base class of the callbacks. Override any of the events; each is optional.

    ``trainer`` is the running :class:`~ddpexp.training.trainer.Trainer`, seen through
    :class:`TrainerView`. What a callback may use of it (docs/callbacks.md):

    - where this process is: ``rank``, ``world_size``, ``is_main``, ``device``, ``run_dir``;
    - what is trained: ``model`` (as wrapped), ``module`` (unwrapped), ``optimizer``,
      ``monitor``, ``monitor_mode``;
    - where the run is, read-only: ``epoch``, ``step``, ``batch``, ``batches_per_epoch``,
      ``resumed``, ``improved`` (the latest validation was the best so far) and ``state``
      (the :class:`~ddpexp.callbacks.state.RunState`: best, metrics, history, status,
      last_saved_step);
    - what it reports: ``loggers``, ``logged`` (the latest training metrics),
      ``log_metrics(dict, step=None)``, ``request_stop(reason, status="stopped")``;
    - for callbacks that save or agree, called on every rank at the same point:
      ``agree()``, ``diverged``, ``leaving_epoch()``, ``weights_finite()``,
      ``save_checkpoint(last, copies, then=None)``.

    Events fire in the order of :data:`EVENTS`; callbacks by ascending :attr:`order`, then
    by name.
    """

    #: Runs before callbacks with a larger order at every event.
    order: int = USER
    #: False leaves the callback out of the run (a built-in one whose key is null).
    enabled: bool = True

    def setup(self, trainer: TrainerView) -> None:
        """Once, when the trainer has been built (before a resume is loaded)."""

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Before the first step, after a resume has been loaded."""

    def on_train_epoch_start(self, trainer: TrainerView) -> None:
        """Before an epoch's first batch (also the resumed part of an epoch)."""

    def on_before_optimizer_step(self, trainer: TrainerView) -> None:
        """The gradients of the step are complete (unscaled, reduced), before the step."""

    def on_train_batch_end(self, trainer: TrainerView) -> None:
        """After each optimizer step (``trainer.step`` counts it already)."""

    def on_validation_start(self, trainer: TrainerView) -> None:
        """Before an epoch's validation."""

    def on_validation_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        """After an epoch's validation: ``metrics`` is ``{"val/<name>": value}``, the same on
        every rank."""

    def on_train_epoch_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        """After the epoch's validation, before its checkpoint."""

    def on_fit_end(self, trainer: TrainerView, result: Mapping[str, Any]) -> None:
        """After the test of ``best.pt``; ``result`` is what ``metrics.json`` holds."""

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        """The run failed (on the rank that raised) or was interrupted by a signal (on every
        rank, with a :class:`~ddpexp.runtime.signals.Interrupted`). Run no collective for a failure:
        the other ranks may be gone."""

    def on_save_checkpoint(self, trainer: TrainerView, checkpoint: dict) -> None:
        """Before ``checkpoint`` (the dict about to be written) is saved: on rank 0, or on
        every rank under ``strategy=fsdp``, where each rank writes its shards (its
        ``"model"`` then holds this rank's shards of the weights)."""

    def on_load_checkpoint(self, trainer: TrainerView, checkpoint: dict) -> None:
        """Every rank, when a checkpoint is resumed, before the trainer reads its weights."""

    def state_dict(self) -> dict:
        """What a resume needs; plain data (what ``torch.load(weights_only=True)`` reads)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def overrides(callback: Callback, event: str) -> bool:
    """Whether ``callback`` implements ``event`` (the base class's are no-ops)."""
    return getattr(type(callback), event, None) is not getattr(Callback, event)


class Dispatch:
    """The callbacks of a run, in order, with each event bound to the callbacks that
    implement it. Firing an event is a loop over a prebuilt tuple of bound methods: nothing is
    looked up or allocated per step, and an event no callback implements costs a loop over
    an empty tuple."""

    def __init__(self, callbacks: Mapping[str, Callback]):
        active = [(name, cb) for name, cb in callbacks.items() if getattr(cb, "enabled", True)]
        ranked = sorted(active, key=lambda item: (getattr(item[1], "order", USER), item[0]))
        self.callbacks: dict[str, Callback] = dict(ranked)
        self._bound: dict[str, tuple[Callable, ...]] = {
            event: tuple(getattr(cb, event) for cb in self.callbacks.values() if overrides(cb, event))
            for event in EVENTS
        }

    def fire(self, event: str, *args: Any) -> None:
        """Call ``event`` on each callback that implements it, in order."""
        for method in self._bound[event]:
            method(*args)

    def __iter__(self) -> Iterator[tuple[str, Callback]]:
        return iter(self.callbacks.items())
