"""A worker's side of stall detection: its heartbeat, the phases it marks, and the layout of
the shared slots file the launching process's watchdog (:mod:`ddpexp.launch.watchdog`) reads.

Every worker records where it is (a phase and the step) in a slot of a small shared file at
each phase change: one memory write into an ``mmap``, no system call and no collective on the
hot path. The launching process creates the file and hands it to its workers through the
environment (:data:`ENV_SLOTS`); without it a worker's heartbeat does nothing. Both sides
read the names here, so they live apart from either.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import time
from pathlib import Path
from typing import IO, cast

# Where a rank is; the trainer marks each change. The order is the order within a step.
PHASES = ("setup", "data", "forward", "backward", "optimizer", "validation", "checkpoint", "done")
SETUP, DATA, FORWARD, BACKWARD, OPTIMIZER, VALIDATION, CHECKPOINT, DONE = range(len(PHASES))

# The environment variables through which the launching process hands the slots file and the
# run's log to its workers (torch elastic passes the environment on).
ENV_SLOTS = "DDPEXP_HEARTBEAT_FILE"
ENV_STACK_LOG = "DDPEXP_STACK_LOG"

# A slot: phase changes so far, step, phase, wall time of the change, pid, restart round,
# global rank (the slot's index is the local rank).
SLOT = struct.Struct("<qqqdqqq")
STRIDE = 64
# With a watchdog the collectives wait this much longer than trainer.dist_timeout_s, so
# that the watchdog, which names the stalled rank, acts before torch's timeout, which names
# a waiting one.
COLLECTIVE_MARGIN_S = 5.0


class Heartbeat:
    """This rank's slot. :meth:`mark` costs one ``struct.pack_into`` into shared memory."""

    def __init__(self, slots_path: str, local_rank: int, restart: int = 0,
                 stack_log: str | None = None, rank: int | None = None) -> None:
        fd = os.open(slots_path, os.O_RDWR)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._offset = local_rank * STRIDE
        self._count = 0
        self._pid = os.getpid()
        self._restart = restart
        self._rank = local_rank if rank is None else rank
        self._stack_file: IO[str] | None = None
        if stack_log:
            # faulthandler writes through this file descriptor from its signal handler,
            # even while the rank is stuck in C code holding the GIL.
            self._stack_file = open(stack_log, "a")
            faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True,
                                  chain=False)
        self.mark(SETUP, 0)

    def mark(self, phase: int, step: int) -> None:
        """Record that this rank entered ``phase`` (one of the module's constants) at ``step``."""
        self._count += 1
        SLOT.pack_into(cast(mmap.mmap, self._mm), self._offset, self._count, step, phase, time.time(),
                       self._pid, self._restart, self._rank)

    def close(self) -> None:
        """Mark the rank done (the watchdog then leaves it alone) and release the slot."""
        if self._mm is None:
            return
        self.mark(DONE, 0)
        self._mm.close()
        self._mm = None
        if self._stack_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stack_file.close()


class NoHeartbeat:
    """Stands in for :class:`Heartbeat` where no watchdog listens (one worker in-process)."""

    def mark(self, phase: int, step: int) -> None:
        """Nothing to record."""

    def close(self) -> None:
        """Nothing to release."""


def heartbeat_from_env(local_rank: int, restart: int = 0,
                       rank: int | None = None) -> Heartbeat | NoHeartbeat:
    """This worker's heartbeat if the launching process runs a watchdog, else a no-op."""
    path = os.environ.get(ENV_SLOTS)
    if not path or not Path(path).is_file():
        return NoHeartbeat()
    return Heartbeat(path, local_rank, restart, os.environ.get(ENV_STACK_LOG), rank)
