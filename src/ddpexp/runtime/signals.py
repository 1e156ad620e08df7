"""The signals that stop a run with a checkpoint, and the flag the training loop reads.

Both the parent (:mod:`ddpexp.launch.fanout`, which hands them to torch elastic's agent)
and every worker (the trainer, which checks the flag at step boundaries) use these, so they
live apart from either.
"""

from __future__ import annotations

import os
import signal
from typing import Any


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a run with a checkpoint: SIGTERM and SIGINT, plus the
    pre-timeout signal of a SLURM job (submitit's ``SUBMITIT_PREEMPT_SIGNAL``, SIGUSR2 by
    default), which only a SLURM or submitit job is sent."""
    sigs = [signal.SIGTERM, signal.SIGINT]
    if any(k.startswith("SUBMITIT_") for k in os.environ) or "SLURM_JOB_ID" in os.environ:
        name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
        preempt = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if preempt is not None and preempt not in sigs:
            sigs.append(preempt)
    return tuple(sigs)


class StopRequested:
    """Turns the :func:`stop_signals` into a flag the loop checks at step boundaries.

    In a process of its own (no elastic agent) a second signal raises ``KeyboardInterrupt``
    at once, for a user who presses Ctrl-C twice. Under torch elastic a second one is
    ignored: Ctrl-C reaches a worker both from the terminal and forwarded by the agent, and
    the agent itself kills workers that overrun ``trainer.shutdown_grace_s``."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.escalate = "TORCHELASTIC_RUN_ID" not in os.environ
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequested:
        for sig in stop_signals():
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.signum is not None and self.escalate and signal.SIGINT in self._previous:
            # The run is stopping on the first signal (its checkpoint, its record): a Ctrl-C
            # from here on is still the user's second one.
            signal.signal(signal.SIGINT, self._second)

    def _second(self, signum: int, frame: Any) -> None:
        raise SecondSignal

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if self.escalate:
                raise SecondSignal
            return
        self.signum = signum

    @property
    def name(self) -> str | None:
        """The signal's name (``"SIGINT"``), or None when none arrived."""
        return signal.Signals(self.signum).name if self.signum else None

    def __bool__(self) -> bool:
        return self.signum is not None


class SecondSignal(KeyboardInterrupt):
    """A second stop signal to a process of its own: the user asked twice, so the run stops
    at once, without the checkpoint the first one was waiting for."""


class Interrupted(Exception):
    """What callbacks' ``on_exception`` receives when a stop signal ended the run (on every
    rank, once the ranks agreed on it); ``signal`` is its name, e.g. ``"SIGTERM"``."""

    def __init__(self, signal_name: str | None):
        super().__init__(f"stopped by {signal_name or 'a stop signal'}")
        self.signal = signal_name
