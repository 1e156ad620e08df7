"""The run's counters as one object: :class:`RunState`, which the trainer holds as
``trainer.state`` and which the checkpoint schema (:mod:`ddpexp.training.checkpoint_state`)
reads with :meth:`RunState.state_dict` and restores with :meth:`RunState.load_state_dict`.

Only the trainer changes it while a run goes; callbacks read it (``trainer.state``, and the
trainer's read-only ``epoch``, ``step``, ``batch``, ``improved``). It is part of what a
callback is shown of the run (:class:`ddpexp.callbacks.base.TrainerView`), so it lives with
the callbacks' seam, which the loop imports, rather than with the loop: the callbacks, the
checkpoint schema and the unit tests import it without the loop (and the loop's imports).

The keys :meth:`RunState.state_dict` returns are those of checkpoint format 3 (``epoch``,
``batch``, ``step``, ``best``, ``metrics``, ``history``), unchanged from before the counters
were one object, so every checkpoint written since reads back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Best:
    """The best validation of ``metric`` so far (``mode`` ``max``: larger is better) and
    whether the latest one was it (``improved``): what picks ``best.pt``, the log line's
    ``*best*``, ``best/<metric>`` and ``metrics.json``'s ``best``."""

    metric: str
    mode: str = "min"
    value: float | None = None
    epoch: int | None = None
    improved: bool = False

    def update(self, value: float, epoch: int) -> bool:
        """Record the validation of ``epoch``; return (and keep in ``improved``) whether it
        is strictly better than every one before. A non-finite value never is; a tie keeps
        the earlier epoch."""
        better = math.isfinite(value) and (
            self.value is None or (value > self.value if self.mode == "max" else value < self.value))
        if better:
            self.value, self.epoch = value, epoch
        self.improved = better
        return better

    def state_dict(self) -> dict:
        """The checkpoint's ``best`` entry: ``{"metric", "value", "epoch"}``."""
        return {"metric": self.metric, "value": self.value, "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's ``best`` entry (this run's ``metric`` and ``mode`` are
        kept, as they always were)."""
        self.value, self.epoch = state["value"], state["epoch"]
        self.improved = False


@dataclass
class RunState:
    """Where a run is: the position in its epochs and steps, what validation found so far,
    how it ends.

    ``epoch``: the epoch being trained (0-based); ``batch``: its micro-batches done;
    ``step``: optimizer steps done in all; ``epoch_finished``: the epoch has been trained and
    validated, so a checkpoint taken now resumes at the next one; ``metrics``: the latest
    validation's ``{"val/<name>": value}``; ``history``: every validation's
    ``{"epoch", "step", "val/<name>"...}``; ``status``: ``running`` until the run ends
    (``completed``, ``stopped``, ``diverged`` ...); ``last_saved_step``: the step of the
    newest checkpoint (None before the first), which a divergence's message names."""

    best: Best
    epoch: int = 0
    batch: int = 0
    step: int = 0
    epoch_finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    status: str = "running"
    last_saved_step: int | None = None

    def resume_point(self) -> tuple[int, int]:
        """(epoch, batch) where a resume from a checkpoint taken now continues."""
        return (self.epoch + 1, 0) if self.epoch_finished else (self.epoch, self.batch)

    def state_dict(self) -> dict:
        """The checkpoint's entries of the counters (see :mod:`ddpexp.training.checkpoint_state`):
        ``epoch`` and ``batch`` are where a resume continues."""
        epoch, batch = self.resume_point()
        return {"epoch": epoch, "batch": batch, "step": self.step, "best": self.best.state_dict(),
                "metrics": self.metrics, "history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s entries (a checkpoint's, its ``batch`` already
        in this run's micro-batches). The checkpoint read is the newest one saved."""
        self.epoch, self.batch, self.step = int(state["epoch"]), int(state["batch"]), int(state["step"])
        self.best.load_state_dict(state["best"])
        self.metrics, self.history = dict(state["metrics"]), list(state["history"])
        self.epoch_finished = False
        self.last_saved_step = self.step
