"""A user callback (``+callbacks.slowsave._target_=slowsave.SlowSave``) that holds the
background write of the run's ``at``-th checkpoint (``trainer.async_save``): once that save's
state has been copied and its writer thread starts, it writes ``marker`` (the step saved) and
sleeps ``hold_s`` before the write begins, so that a test can kill the run while the save is
in flight, or see the loop go on meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

from ddpexp import Callback


class SlowSave(Callback):
    def __init__(self, at: int = 2, marker: str = "", hold_s: float = 600.0):
        self.at, self.marker, self.hold_s = int(at), marker, float(hold_s)
        self.saves = 0

    def setup(self, trainer) -> None:
        if trainer.is_main:
            trainer.saver.before_write = self._hold

    def on_save_checkpoint(self, trainer, checkpoint: dict) -> None:
        self.saves += 1
        self.step = trainer.step  # in the loop's thread: the step being saved

    def _hold(self) -> None:
        if self.saves != self.at:
            return
        if self.marker:  # whole once it appears: a test reads it as soon as it exists
            tmp = Path(f"{self.marker}.tmp")
            tmp.write_text(str(self.step))
            tmp.replace(self.marker)
        time.sleep(self.hold_s)
