"""The errors ddpexp reports to users.

They derive from Hydra's ``CompactHydraException``: Hydra then prints just the message on
stderr and exits 1, and ``HYDRA_FULL_ERROR=1`` still shows the whole traceback.
"""

from __future__ import annotations

from hydra.errors import CompactHydraException


class DdpexpError(CompactHydraException):
    """Something the user can fix; the message says what is wrong and what to do."""


class ConfigError(DdpexpError):
    """A config value that cannot work (bad value, too many GPUs, missing dataset)."""


class CheckpointError(DdpexpError):
    """A checkpoint that cannot be read safely (corrupt, truncated, or unsafe pickles)."""


class DataError(DdpexpError):
    """Data that cannot be read once the run is under way (a shard gone, cut or unreadable)."""


class RunFailed(DdpexpError):
    """A worker died, raised or stalled; the message names the rank and the cause."""


class RunDiverged(DdpexpError):
    """The training loss became NaN or infinite; the message says where and what to try."""


class RunInterrupted(DdpexpError):
    """SIGTERM/SIGINT stopped the run after a checkpoint; the message says how to resume.
    ``signal`` names the signal (e.g. ``"SIGUSR2"``) where it is known."""

    def __init__(self, message: str, signal: str | None = None):
        super().__init__(message)
        self.signal = signal


class RunDirBusy(DdpexpError):
    """Another live run holds the run dir's lock; the message names it (host, pid, since)."""


def naming(exc: OSError, path: object) -> OSError:
    """``exc``, naming ``path`` where it names no file. A write whose bytes only meet the
    full disk when the file is flushed or closed fails with an ``OSError`` that has no file
    name; the writer knows which file it was, and the user's message should say it."""
    if exc.filename is not None:
        return exc
    named = type(exc)(exc.errno, exc.strerror or str(exc), str(path))
    named.__traceback__ = exc.__traceback__
    return named
