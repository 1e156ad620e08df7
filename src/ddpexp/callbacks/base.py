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

``Trainer`` in the signatures is :class:`ddpexp.training.trainer.Trainer`, which imports this module
(so this one imports it only for the type checker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from ddpexp.training.trainer import Trainer


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


class Callback:
    """Base class of the callbacks. Override any of the events; each is optional.

    ``trainer`` is the running :class:`~ddpexp.training.trainer.Trainer`. What a callback may use of
    it: ``epoch``, ``step``, ``rank``, ``world_size``, ``is_main``, ``run_dir``, ``model``
    (as wrapped), ``module`` (unwrapped), ``optimizer``, ``loggers``, ``monitor``,
    ``log_metrics(dict)`` and ``request_stop(reason)``.
    """

    #: Runs before callbacks with a larger order at every event.
    order: int = USER
    #: False leaves the callback out of the run (a built-in one whose key is null).
    enabled: bool = True

    def setup(self, trainer: Trainer) -> None:
        """Once, when the trainer has been built (before a resume is loaded)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step, after a resume has been loaded."""

    def on_train_epoch_start(self, trainer: Trainer) -> None:
        """Before an epoch's first batch (also the resumed part of an epoch)."""

    def on_before_optimizer_step(self, trainer: Trainer) -> None:
        """The gradients of the step are complete (unscaled, reduced), before the step."""

    def on_train_batch_end(self, trainer: Trainer) -> None:
        """After each optimizer step (``trainer.step`` counts it already)."""

    def on_validation_start(self, trainer: Trainer) -> None:
        """Before an epoch's validation."""

    def on_validation_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        """After an epoch's validation: ``metrics`` is ``{"val/<name>": value}``, the same on
        every rank."""

    def on_train_epoch_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        """After the epoch's validation, before its checkpoint."""

    def on_fit_end(self, trainer: Trainer, result: Mapping[str, Any]) -> None:
        """After the test of ``best.pt``; ``result`` is what ``metrics.json`` holds."""

    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        """The run failed (on the rank that raised) or was interrupted by a signal (on every
        rank, with a :class:`~ddpexp.training.signals.Interrupted`). Run no collective for a failure:
        the other ranks may be gone."""

    def on_save_checkpoint(self, trainer: Trainer, checkpoint: dict) -> None:
        """Before ``checkpoint`` (the dict about to be written) is saved: on rank 0, or on
        every rank under ``strategy=fsdp``, where each rank writes its shards (its
        ``"model"`` then holds this rank's shards of the weights)."""

    def on_load_checkpoint(self, trainer: Trainer, checkpoint: dict) -> None:
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

    def __iter__(self) -> Iterable[tuple[str, Callback]]:
        return iter(self.callbacks.items())
