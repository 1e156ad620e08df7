"""``python -m ddpexp``: train, from scratch or on from a checkpoint."""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from ddpexp.checkpoint.io import newest_last
from ddpexp.config.modes import RunMode, Runnable, SpecView

log = logging.getLogger("ddpexp")


@dataclasses.dataclass(frozen=True)
class Train(RunMode):
    """Train the spec's experiment; resume from ``spec.resume_from`` (the changes the parent
    let through applied), or, in a restart of the worker group by torch elastic, from the
    newest ``last.pt`` the run saved."""

    name: ClassVar[str] = "train"

    def run(self, trainer: Runnable, spec: SpecView) -> dict | None:
        ctx = trainer.ctx
        resume_from = spec.resume_from
        if ctx.restart > 0:
            last = newest_last(spec.run_dir / "checkpoints")
            resume_from = last if last is not None else resume_from
            if ctx.is_main:
                log.warning("restart %d of the worker group: resuming from %s", ctx.restart,
                            resume_from or "scratch (no checkpoint yet)")
        return trainer.fit(resume_from, spec.resume_changes)
