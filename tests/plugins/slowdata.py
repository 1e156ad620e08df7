"""Synthetic data that takes its time to load, as a large data set on a slow disk does: it
marks the file ``started`` when loading begins, then waits ``seconds`` before the data is
there. A test signals the run inside that window, before the trainer's first step. Only the
first load waits (the one that made ``started``): the same command run again is quick."""

from __future__ import annotations

import time
from pathlib import Path

from ddpexp.data.sources import Synthetic


class SlowSynthetic(Synthetic):
    def __init__(self, started: str, seconds: float = 30.0, **kwargs):
        super().__init__(**kwargs)
        self.started, self.seconds = started, seconds

    def load(self):
        marker = Path(self.started)
        if not marker.exists():
            marker.touch()
            time.sleep(self.seconds)
        return super().load()
