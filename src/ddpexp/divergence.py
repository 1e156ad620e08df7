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
from typing import Optional


class LossCeiling:
    """The highest training loss a run may reach before it counts as diverged."""

    def __init__(self, factor: Optional[float]):
        self.factor = factor  # None: only a non-finite loss counts as diverged
        self.start: Optional[float] = None

    def set_start(self, loss: float) -> None:
        """The loss of the initial weights; a non-finite one leaves no ceiling."""
        self.start = loss if math.isfinite(loss) else None

    @property
    def limit(self) -> Optional[float]:
        """The loss above which the run has diverged, or None where there is no ceiling."""
        if self.factor is None or self.start is None:
            return None
        return self.start + (self.factor - 1.0) * max(abs(self.start), 1.0)

    def exceeded(self, loss: float) -> bool:
        """Whether the (finite) agreed training loss ``loss`` is past the ceiling."""
        limit = self.limit
        return limit is not None and loss > limit
