"""A logger's writer: the bounded queue that global rank 0 hands a logger's points to, and the
thread that sends them on, so that no backend is ever on the training loop's path.

Each :class:`~ddpexp.loggers.base.Logger` gets its own :class:`Writer` (one thread per logger,
so a tracker stuck in HTTP holds up neither the loop nor the local files). The loop's
:meth:`Writer.put` appends to a queue of at most :data:`QUEUE_POINTS` points and returns; a
full queue drops its oldest points and counts them. The thread makes every call on the logger,
in the trainer's order: ``load_state_dict``, ``open``, ``log_hparams``, ``log_metrics`` for each
queued call, ``flush`` (after which those points are *acknowledged*), ``state_dict``, and
``finalize`` at the end.

The points of the newest step are held back until a later step is queued (or the run ends),
so an acknowledged step is a complete one: a checkpoint records the last acknowledged step and
the points queued after it (:meth:`Writer.snapshot`); a resumed session tells the logger that
steps up to that one are stored and sends those points first, so nothing is sent twice and
nothing the logger had is skipped.

A call that raises loses the points since the last acknowledgement: the first loss is one
warning naming the logger and the step from which its points are missing, later ones at most
one warning a minute; the run trains on, and :attr:`Writer.lost` (which ``metrics.json``
lists) counts the points and their step ranges. :meth:`Writer.wait` waits at most the
logger's ``flush_timeout_s`` for the queue to be sent and the logger finalized; a thread
still stuck then is a daemon, left behind (it keeps no process alive).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ddpexp.loggers.base import Logger, RunInfo

log = logging.getLogger("ddpexp")

# Points a logger's queue holds before it drops the oldest: at 20 metrics per log step, 500
# log steps of a tracker that does not answer.
QUEUE_POINTS = 10_000
# After the first warning of a logger's lost points, at most one a minute.
WARN_EVERY_S = 60.0


# Where an HTTP client logs each retry; from a writer's thread those lines only repeat what
# the writer's own warning says.
RETRY_LOGGERS = ("urllib3.connectionpool",)
THREAD_PREFIX = "ddpexp-logger-"


def _not_from_a_writer(record: logging.LogRecord) -> bool:
    return not (record.threadName or "").startswith(THREAD_PREFIX)


def _quiet_retries() -> None:
    """Leave out the retry lines that HTTP clients log from writer threads (once)."""
    for name in RETRY_LOGGERS:
        retries = logging.getLogger(name)
        if _not_from_a_writer not in retries.filters:
            retries.addFilter(_not_from_a_writer)


@dataclass
class Call:
    """One ``log_metrics`` call waiting in the queue."""

    metrics: dict
    step: int
    epoch: int

    def as_list(self) -> list:
        """As a checkpoint holds it: ``[step, epoch, {name: value}]``."""
        return [self.step, self.epoch, self.metrics]


class Losses:
    """The points a logger never stored: how many, and the step ranges they span (a range
    grows while no point in between is acknowledged)."""

    def __init__(self, saved: Mapping[str, Any] | None = None):
        saved = saved or {}
        self.points = int(saved.get("points", 0))
        self.steps: list[list[int]] = [list(r) for r in saved.get("steps", [])]
        self._growing = False

    def add(self, calls: list[Call]) -> None:
        """Count ``calls`` as lost."""
        if not calls:
            return
        first = min(c.step for c in calls)
        last = max(c.step for c in calls)
        self.points += sum(len(c.metrics) for c in calls)
        if self._growing and self.steps:
            self.steps[-1] = [min(self.steps[-1][0], first), max(self.steps[-1][1], last)]
        else:
            self.steps.append([first, last])
            self._growing = True

    def stored(self) -> None:
        """A later point was acknowledged: the next loss starts a new range."""
        self._growing = False

    def as_dict(self) -> dict:
        """``{"points": n, "steps": [[first, last], ...]}``, as metrics.json and checkpoints
        hold it."""
        return {"points": self.points, "steps": [list(r) for r in self.steps]}


def _steps(calls: list[Call]) -> str:
    first = min(c.step for c in calls)
    last = max(c.step for c in calls)
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _cause(exc: BaseException) -> str:
    """An exception on one line, cut short (a tracker's errors quote whole responses)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


class Writer:
    """The queue and thread of the logger ``name``: see the module docstring."""

    def __init__(self, name: str, logger: Logger, capacity: int = QUEUE_POINTS,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.logger, self.capacity, self._clock = name, logger, capacity, clock
        self._cond = threading.Condition()
        self._queue: deque[Call] = deque()
        self._queued_points = 0
        self._newest: int | None = None
        self._inflight: list[Call] = []
        self._acked_step: int | None = None
        self._state: dict = {}
        self._saved: dict | None = None
        self._status: str | None = None  # the run's status once end() was called
        self._abandoned = False
        self._broken = False  # open() failed: every point is lost
        self._last_flush = clock()
        self._warned_at: float | None = None
        self._thread: threading.Thread | None = None
        self._opened = threading.Event()
        self.lost = Losses()

    # ------------------------------------------------------------------ the loop's side
    def load(self, state: dict | None, queue: Mapping[str, Any] | None) -> None:
        """What a checkpoint held: the logger's ``state`` (None: none saved) and this
        writer's ``queue`` entry (None: a checkpoint from before writers, whose step was
        stored whole)."""
        self._saved = state
        self._state = dict(state or {})
        if queue is not None:
            self._acked_step = int(queue.get("acked_step") or 0)
            for step, epoch, metrics in queue.get("pending", []):
                self._queue.append(Call(dict(metrics), int(step), int(epoch)))
                self._queued_points += len(metrics)
                self._newest = int(step)
            self.lost = Losses(queue.get("lost"))

    def start(self, run: RunInfo) -> None:
        """Start the thread, which opens the logger for ``run``. A resumed logger is told
        that the steps up to the last one it acknowledged are stored (the points after it
        are in the queue, or come again from the loop)."""
        if run.resumed and self._acked_step is not None:
            run = replace(run, step=self._acked_step)
        _quiet_retries()
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True,
                                        name=THREAD_PREFIX + self.name)
        self._thread.start()

    def wait_open(self, since: float) -> None:
        """Wait until the thread has opened the logger, at most the logger's
        ``flush_timeout_s`` after ``since`` (a ``time.monotonic()`` reading): a tracker's
        set-up (imports, a database's schema check, its run and params) then does not compete
        with the first steps for the CPU; one slower than that goes on beside them."""
        self._opened.wait(max(0.0, since + float(self.logger.flush_timeout_s) - time.monotonic()))

    def put(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """Queue one point per name; never waits. A full queue drops its oldest calls."""
        call = Call(dict(metrics), int(step), int(epoch))
        dropped: list[Call] = []
        with self._cond:
            if self._status is not None:
                return
            self._queue.append(call)
            self._queued_points += len(call.metrics)
            self._newest = call.step if self._newest is None else max(self._newest, call.step)
            while self._queued_points > self.capacity and len(self._queue) > 1:
                old = self._queue.popleft()
                self._queued_points -= len(old.metrics)
                dropped.append(old)
            if dropped:
                self.lost.add(dropped)
            self._cond.notify()
        if dropped:
            self._warn(dropped, f"its queue is full ({self.capacity:,} points), the oldest "
                                "are dropped")

    def snapshot(self) -> tuple[dict, dict]:
        """What a checkpoint saves: the logger's state at its last acknowledgement, and
        ``{"acked_step", "pending": [[step, epoch, metrics], ...], "lost"}``."""
        with self._cond:
            pending = [c.as_list() for c in (*self._inflight, *self._queue)]
            return dict(self._state), {"acked_step": self._acked_step, "pending": pending,
                                       "lost": self.lost.as_dict()}

    def end(self, status: str) -> None:
        """The run has ended with ``status``: the thread sends what is queued, then calls
        ``finalize(status)``; later points are ignored."""
        with self._cond:
            if self._status is None:
                self._status = status
                self._cond.notify()

    def wait(self, since: float) -> None:
        """Wait for the thread until the logger's ``flush_timeout_s`` after ``since`` (a
        ``time.monotonic()`` reading: when :meth:`end` was called); what the logger has not
        taken by then is counted as lost, and the thread is left behind."""
        thread = self._thread
        if thread is None or self._abandoned:
            return
        timeout = float(self.logger.flush_timeout_s)
        thread.join(max(0.0, since + timeout - time.monotonic()))
        if not thread.is_alive():
            return
        with self._cond:
            self._abandoned = True
            left = [*self._inflight, *self._queue]
            self._inflight, self._queued_points = [], 0
            self._queue.clear()
            self.lost.add(left)
        if left:
            self._warn(left, f"it had not taken them {timeout:g} s after the run ended "
                             f"(logger.{self.name}.flush_timeout_s)", final=True)

    # ------------------------------------------------------------------ the thread
    def _run(self, run: RunInfo) -> None:
        try:
            if self._saved is not None:
                self.logger.load_state_dict(self._saved)
            self.logger.open(run)
            if not run.resumed:
                self.logger.log_hparams(run.hparams)
            state = self.logger.state_dict()
        except Exception as exc:
            self._broken = True
            log.warning("logger.%s could not open (%s): it records nothing of this run from "
                        "step %d on; the run trains on", self.name, _cause(exc), run.step + 1)
            self._warned_at = self._clock()
        else:
            with self._cond:
                self._state = state
        finally:
            self._opened.set()
        while True:
            calls = self._take()
            if calls is None:
                break
            self._send(calls)
        with self._cond:
            if self._abandoned:
                return
        try:
            self.logger.finalize(self._status or "failed")
        except Exception as exc:
            log.warning("logger.%s could not finish: %s", self.name, _cause(exc))

    def _take(self) -> list[Call] | None:
        """The next calls to send once they are due; None once the run has ended and the
        queue is empty, or the writer was abandoned."""
        with self._cond:
            while True:
                if self._abandoned:
                    return None
                ending = self._status is not None
                ready = len(self._queue) if ending else self._ready()
                wait = None
                if ready:
                    wait = self._until_due(ready)
                    if ending or wait <= 0:
                        calls = [self._queue.popleft() for _ in range(ready)]
                        self._queued_points -= sum(len(c.metrics) for c in calls)
                        self._inflight = calls
                        return calls
                elif ending:
                    return None
                self._cond.wait(wait)

    def _ready(self) -> int:
        """How many queued calls are before the newest step (those of the newest step wait
        for a later one, so that an acknowledged step is complete)."""
        count = 0
        for call in self._queue:
            if call.step >= (self._newest or 0):
                break
            count += 1
        return count

    def _until_due(self, ready: int) -> float:
        """Seconds until the ``ready`` calls are due: at once when they hold the logger's
        ``flush_every_points``, else ``flush_every_s`` after the last flush."""
        points = sum(len(self._queue[i].metrics) for i in range(ready))
        if points >= self.logger.flush_every_points:
            return 0.0
        return self._last_flush + float(self.logger.flush_every_s) - self._clock()

    def _send(self, calls: list[Call]) -> None:
        try:
            if self._broken:
                raise RuntimeError("it could not open")
            for call in calls:
                self.logger.log_metrics(call.metrics, call.step, call.epoch)
            self.logger.flush()
            state = self.logger.state_dict()
        except Exception as exc:
            with self._cond:
                if self._abandoned:
                    return
                self._inflight = []
                self.lost.add(calls)
            if not self._broken:
                self._warn(calls, _cause(exc))
            return
        with self._cond:
            if self._abandoned:
                return
            self._inflight = []
            self._acked_step = max(calls[-1].step, self._acked_step or 0)
            self._state = state
            self._last_flush = self._clock()
            self.lost.stored()

    def _warn(self, calls: list[Call], why: str, final: bool = False) -> None:
        """The first loss is a warning naming the step from which points are missing; later
        ones at most one a minute, else debug lines (``final``, the loss at the end of the
        run: an info line)."""
        with self._cond:
            now, first = self._clock(), self._warned_at is None
            if not first and now - self._warned_at < WARN_EVERY_S:  # pyright: ignore[reportOperatorIssue]  # not first: set
                (log.info if final else log.debug)("logger.%s lost %s: %s", self.name,
                                                   _steps(calls), why)
                return
            self._warned_at = now
            total = self.lost.as_dict()
        if first:
            log.warning("logger.%s lost points from step %d on (%s): %s; the run trains on, and "
                        "metrics.json lists the steps it lost", self.name,
                        min(c.step for c in calls), _steps(calls), why)
        else:
            log.warning("logger.%s has lost %d point(s) so far, steps %s (latest: %s): %s",
                        self.name, total["points"],
                        ", ".join(f"{a}-{b}" for a, b in total["steps"]), _steps(calls), why)
