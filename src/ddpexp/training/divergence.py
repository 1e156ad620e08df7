"""When a finite training loss counts as diverged (``trainer.divergence_factor``).

A loss that turns NaN or infinite has diverged by any measure. A finite one has when it
has risen far above where it started: ``optimizer.lr=1e6`` on the default run ends with
losses near 1e6 that are finite, and the run would otherwise be reported as a success.

The start is the training loss of the initial weights on the probe batch (the first
training samples, which every rank checks before the first step): the loss before any
update, identical on every rank without communication, and the same again when a run is
resumed (its config and seed rebuild the same initial weights). The loss it is compared
with is the mean over all ranks' samples since the last log step, agreed on in the
collective that the trainer runs there (and at validation) anyway. Each loss is measured
before its step's update, so an update that explodes the weights shows at the next check.

The rule: diverged when ``loss > start + (factor - 1) * max(|start|, 1)``. For a start of
at least 1 that is ``loss > factor * start``; the floor of 1 keeps a start near zero or
below it (a regression that begins close to its targets, a loss that can be negative)
from turning ordinary noise into a false alarm: the loss must then rise by ``factor - 1``
in absolute terms. Only a rise counts; a loss that falls without bound is not told apart
from one that improves.
"""

from __future__ import annotations

import math


class LossCeiling:
    """The highest training loss a run may reach before it counts as diverged."""

    def __init__(self, factor: float | None):
        self.factor = factor  # None: only a non-finite loss counts as diverged
        self.start: float | None = None

    def set_start(self, loss: float) -> None:
        """The loss of the initial weights; a non-finite one leaves no ceiling."""
        self.start = loss if math.isfinite(loss) else None

    @property
    def limit(self) -> float | None:
        """The loss above which the run has diverged, or None where there is no ceiling."""
        if self.factor is None or self.start is None:
            return None
        return self.start + (self.factor - 1.0) * max(abs(self.start), 1.0)

    def exceeded(self, loss: float) -> bool:
        """Whether the (finite) agreed training loss ``loss`` is past the ceiling."""
        limit = self.limit
        return limit is not None and loss > limit


class Divergence:
    """Where a run diverged, once its ranks agreed that it did (falsy until then)."""

    def __init__(self, factor: float | None):
        self.ceiling = LossCeiling(factor)  # its start is set by the probe batch
        self.at: dict | None = None  # {"step", "epoch", "loss"}

    def __bool__(self) -> bool:
        return self.at is not None

    def check(self, nonfinite: float, loss_sum: float, seen: float, own_loss: float | None,
              step: int, epoch: int) -> None:
        """At an agreement point: ``nonfinite`` counts the non-finite training sums of all
        ranks, ``loss_sum / seen`` is the agreed training loss since the last log step, and
        ``own_loss`` this rank's own pending sum (named when only it went non-finite)."""
        if self.at is not None:
            return
        if nonfinite:
            self.note(step, epoch, own_loss if own_loss is not None and not math.isfinite(own_loss) else None)
        elif seen and self.ceiling.exceeded(loss_sum / seen):
            self.note(step, epoch, loss_sum / seen)

    def note(self, step: int, epoch: int, loss: float | None = None) -> None:
        """The run diverged at ``step``: ``loss`` is the finite loss past the ceiling, or the
        non-finite one (None: not finite, or the weights themselves)."""
        if self.at is None:
            self.at = {"step": step, "epoch": epoch, "loss": loss}

    @property
    def exploded(self) -> bool:
        """Whether it is a finite loss past trainer.divergence_factor."""
        loss = (self.at or {}).get("loss")
        return loss is not None and math.isfinite(loss)

    def warning(self) -> str:
        """The log line when the run stops."""
        return ("the training loss rose past trainer.divergence_factor times its start"
                if self.exploded else "the training loss is not finite")

    def message(self, lr: float, saved_step: int | None, precision: str) -> str:
        """What happened and what to try, for the log and the run's failure."""
        d = self.at or {}
        what = {None: "NaN or infinite"}.get(d.get("loss"), str(d.get("loss")).replace("nan", "NaN"))
        why = ""
        if self.exploded:
            what = f"{d['loss']:.4g}"
            why = (f", over trainer.divergence_factor={self.ceiling.factor:g} times its start "
                   f"({self.ceiling.start:.4g})")
        kept = "the weights from before the rise" if self.exploded else "the last finite weights"
        saved = (f"checkpoints/last.pt keeps {kept} (step {saved_step})"
                 if saved_step is not None else "no checkpoint had been written yet")
        fixes = f"a smaller optimizer.lr (the last step used {lr:g}) or trainer.grad_clip=1.0"
        if precision != "32":
            fixes += ", or trainer.precision=32"
        return (f"training diverged: the training loss became {what} by step {d.get('step')} "
                f"(epoch {d.get('epoch')}){why}, so the run was stopped; {saved}. Try {fixes}")
