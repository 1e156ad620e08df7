"""The loggers of a run as one object: what the trainer, checkpoints and callbacks call. Each
logger sits behind its own :class:`~ddpexp.loggers.writer.Writer` (queue and thread), so no
call here waits for a backend, except :meth:`Loggers.finalize`, which waits a bounded time."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ddpexp.loggers.writer import Writer
from ddpexp.runtime.signals import stop_signals

log = logging.getLogger("ddpexp")

# The checkpoint's entries (ddpexp.training.checkpoint_state): each logger's state_dict(), and
# what its writer had not yet had acknowledged.
STATES, QUEUES = "loggers", "logger_queues"


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """A stop signal that arrives while the loggers finish is handed on once they have (at
    most their flush_timeout_s later): a SIGTERM then cannot cut a tracker's last calls in
    two, its status tag set and its end state not."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: arrived.append(signum))
                for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if arrived:
            signal.raise_signal(arrived[0])


class Loggers(dict):
    """The run's loggers by name. Only global rank 0 has any: on the other ranks this is
    empty, every call is a no-op and no thread is started."""

    def __init__(self, loggers: Mapping[str, Any] | None = None):
        super().__init__(loggers or {})
        self._writers = {name: Writer(name, logger) for name, logger in self.items()}

    def open(self, run: Any) -> None:
        """Start each logger's writer for ``run`` (a :class:`RunInfo`): it opens the logger
        and hands it a fresh run's hyperparameters. Waits for those, before the first step,
        at most each logger's ``flush_timeout_s``."""
        since = time.monotonic()
        for writer in self._writers.values():
            writer.start(run)
        for writer in self._writers.values():
            writer.wait_open(since)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """Queue the points for every logger; never waits."""
        for writer in self._writers.values():
            writer.put(metrics, step, epoch)

    def finalize(self, status: str) -> None:
        """End each logger with the run's status, waiting for each at most its
        ``flush_timeout_s`` (all at once, not one after the other); one logger's trouble is a
        warning, never what the run is remembered by."""
        if not self._writers:
            return
        since = time.monotonic()
        with _signals_held():
            for writer in self._writers.values():
                writer.end(status)
            for writer in self._writers.values():
                writer.wait(since)

    def lost(self) -> dict:
        """``{name: {"points": n, "steps": [[first, last], ...]}}`` of the loggers that lost
        points in this run (resumed sessions included); metrics.json's ``lost_points``."""
        return {name: w.lost.as_dict() for name, w in self._writers.items() if w.lost.points}

    def state_dict(self) -> dict:
        """The checkpoint's ``loggers`` ({name: the logger's state_dict()}) and
        ``logger_queues`` ({name: the last acknowledged step, the points after it, the points
        lost}) entries."""
        states, queues = {}, {}
        for name, writer in self._writers.items():
            states[name], queues[name] = writer.snapshot()
        return {STATES: states, QUEUES: queues}

    def load_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each logger's saved state, from a checkpoint's entries (a logger added since
        starts afresh, with a warning)."""
        states = checkpoint.get(STATES) or {}
        queues = checkpoint.get(QUEUES) or {}
        for name, writer in self._writers.items():
            if name not in states:
                log.warning("logger.%s has no state in the checkpoint: it starts afresh", name)
            writer.load(states.get(name), queues.get(name))
