"""Stall detection for multi-worker runs: the watchdog that reads the ranks' heartbeats
(:mod:`ddpexp.runtime.heartbeat`, the workers' side) from the launching process.

A rank stuck outside a collective (a model that hangs in ``forward``, a DataLoader worker
that never returns a batch) leaves the other ranks waiting in their next collective; torch's
own timeout then names the *waiting* rank. Here every worker records where it is (a phase
and the step) in a slot of a small shared file at each phase change: one memory write into
an ``mmap``, no system call and no collective on the hot path. The process that started the
workers runs a :class:`Watchdog` thread that reads the slots. When some ranks have been
waiting, one phase ahead of the others, for ``trainer.dist_timeout_s``, the ranks behind are
the stalled ones: the watchdog asks each of them for its Python stack (``faulthandler`` on
SIGUSR1, written into the run's log), then kills the node's workers, and the run fails with
a message naming the stalled ranks, their step and phase, and for how long.

Ranks execute the same sequence of phases (the same batches per epoch, validation and
checkpoints on every rank), so the count of phase changes orders them: the rank with the
smaller count is behind. The watchdog sees the ranks of its own node; across nodes the
collective timeout (``trainer.dist_timeout_s`` plus
:data:`~ddpexp.runtime.heartbeat.COLLECTIVE_MARGIN_S`) still ends the run.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddpexp.runtime.heartbeat import DONE, ENV_SLOTS, ENV_STACK_LOG, PHASES, SLOT, STRIDE

POLL_S = 0.25
# How long a stalled rank gets to write its stack before it is killed.
DUMP_WAIT_S = 3.0


@dataclass(frozen=True)
class Beat:
    """One rank's last recorded position (``rank`` is the global rank)."""

    rank: int
    count: int
    step: int
    phase: int
    time: float
    pid: int
    restart: int

    @property
    def phase_name(self) -> str:
        return PHASES[self.phase] if 0 <= self.phase < len(PHASES) else f"phase {self.phase}"


@dataclass(frozen=True)
class Stall:
    """Ranks that stopped making progress while the others waited for them."""

    stalled: list[Beat]
    waiting: list[Beat]
    waited_s: float

    def describe(self, now: float, log_file: str | None = None) -> str:
        """The run's failure message: who stalled, where, for how long, and what to do."""
        lines = [
            f"rank {b.rank} (pid {b.pid}) stalled in {b.phase_name} at step {b.step}: "
            f"no progress for {now - b.time:.0f} s"
            for b in self.stalled
        ]
        ahead = ("rank " if len(self.waiting) == 1 else "ranks ") + ", ".join(
            str(b.rank) for b in self.waiting)
        where = self.waiting[0].phase_name if self.waiting else "?"
        head = ("a worker stalled, so the whole run was stopped:" if len(lines) == 1 else
                f"{len(lines)} workers stalled, so the whole run was stopped:")
        stack = f"its Python stack is in {log_file}" if log_file else "its Python stack is in the run's log"
        if len(lines) > 1:
            stack = stack.replace("its Python stack is", "their Python stacks are")
        return (
            head + "\n  " + "\n  ".join(lines)
            + f"\n({ahead} waited {self.waited_s:.0f} s for it in {where}, longer than "
            f"trainer.dist_timeout_s; {stack}. A rank that stops in data, forward or backward is "
            "usually stuck in its DataLoader or the model's code; raise trainer.dist_timeout_s "
            "if that phase is legitimately that slow)"
        )


def create_slots(nprocs: int) -> str:
    """A zeroed slots file for ``nprocs`` local workers, in shared memory where there is one."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="ddpexp-heartbeat-", dir=shm)
    try:
        os.write(fd, b"\0" * (STRIDE * nprocs))
    finally:
        os.close(fd)
    return path


def read_beats(slots_path: str, nprocs: int) -> list[Beat]:
    """Every local rank's last position (ranks that have not started yet are left out)."""
    data = Path(slots_path).read_bytes()
    beats = []
    for rank in range(nprocs):
        *fields, global_rank = SLOT.unpack_from(data, rank * STRIDE)
        if fields[0] > 0:
            # Rank numbers in messages are global ranks (on several nodes, not the slot's).
            beats.append(Beat(global_rank, *fields))
    return beats


def find_stall(beats: list[Beat], now: float, stall_s: float) -> Stall | None:
    """The stall in ``beats``, if some ranks have waited ``stall_s`` for ranks behind them.

    Only ranks of the newest restart round that are not done count. The ranks with the most
    phase changes are ahead; when the last of them arrived more than ``stall_s`` ago and
    other ranks are behind, those are stalled."""
    if not beats:
        return None
    latest = max(b.restart for b in beats)
    live = [b for b in beats if b.restart == latest and b.phase != DONE]
    if len(live) < 2:
        return None
    top = max(b.count for b in live)
    ahead = [b for b in live if b.count == top]
    behind = [b for b in live if b.count < top]
    if not behind:
        return None
    waited = now - max(b.time for b in ahead)
    if waited < stall_s:
        return None
    return Stall(stalled=sorted(behind, key=lambda b: b.rank), waiting=ahead, waited_s=waited)


class Watchdog:
    """Watches the local workers' heartbeats from the launching process (a daemon thread).

    On a stall it writes a header and each stalled rank's stack into ``log_file``, kills the
    local workers and keeps the message in :attr:`message` for the run's failure."""

    def __init__(self, nprocs: int, stall_s: float, log_file: str | None,
                 kill: Callable[[list[int]], None] | None = None) -> None:
        self.nprocs, self.stall_s, self.log_file = nprocs, float(stall_s), log_file
        self.path = create_slots(nprocs)
        self.message: str | None = None
        self._kill = kill or _kill_all
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddpexp-watchdog", daemon=True)
        self._saved_env: dict[str, str | None] = {}

    def env(self) -> dict[str, str]:
        """What the workers need to find their slots and the log their stacks go to."""
        out = {ENV_SLOTS: self.path}
        if self.log_file:
            out[ENV_STACK_LOG] = self.log_file
        return out

    def __enter__(self) -> Watchdog:
        # Workers inherit this process's environment (torch elastic passes it on).
        for key, value in self.env().items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=DUMP_WAIT_S + 2)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                beats = read_beats(self.path, self.nprocs)
            except OSError:
                return
            stall = find_stall(beats, time.time(), self.stall_s)
            if stall is not None:
                self._act(stall, beats)
                # A restarted group starts with fresh slots; keep watching it.
                self._stop.wait(self.stall_s)

    def _act(self, stall: Stall, beats: list[Beat]) -> None:
        now = time.time()
        self.message = stall.describe(now, self.log_file)
        for beat in stall.stalled:
            self._dump_stack(beat, now)
        self._kill([b.pid for b in beats if b.phase != DONE])

    def _dump_stack(self, beat: Beat, now: float) -> None:
        """Ask the stalled rank for its stack (faulthandler, SIGUSR1) and wait for it."""
        if not self.log_file:
            return
        log = Path(self.log_file)
        try:
            with open(log, "a") as f:
                f.write(f"[rank{beat.rank}] stalled in {beat.phase_name} at step {beat.step} for "
                        f"{now - beat.time:.0f} s; its Python stack (most recent call first):\n")
            size = log.stat().st_size
            os.kill(beat.pid, signal.SIGUSR1)
        except OSError:
            return
        deadline = time.time() + DUMP_WAIT_S
        while time.time() < deadline:
            time.sleep(0.05)
            try:
                grown = log.stat().st_size
            except OSError:
                return
            if grown > size:
                time.sleep(0.2)  # the rest of the dump, written in a few pieces
                return


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
