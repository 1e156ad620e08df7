"""What a sweep's driver and its backend are handed: the launcher's typed settings and the
Hydra set-up of the sweep, never the launcher object.

Each launcher of ``hydra_plugins.ddpexp_launcher`` declares the ``hydra.launcher.*`` keys it
takes (its config dataclass) and, in ``setup()``, turns them into one of the settings below:
:class:`SweepSettings` holds what the driver reads on every backend, :class:`LocalSettings`
and :class:`RaySettings` add what only their backend reads. The values are checked once,
here, as they are made: a launcher's ``setup()`` runs before a sweep writes anything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ddpexp.errors import ConfigError, DdpexpError
from ddpexp.sweep.backend import HydraSetup, SweepInterrupted

if TYPE_CHECKING:
    from hydra.types import HydraContext, TaskFunction
    from omegaconf import DictConfig

    from ddpexp.sweep.backend import Backend


def max_parallel_problem(value: Any) -> str | None:
    """Why ``hydra.launcher.max_parallel=value`` cannot work (below 1: it would run nothing,
    or quietly one job at a time), or None."""
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value >= 1:
        return None
    return (f"hydra.launcher.max_parallel={value} must be >= 1 (K jobs at once, each on its own "
            "slice of the machine), or null (as many at once as the machine holds)")


@dataclass(frozen=True)
class SweepSettings:
    """What the driver reads of every launcher: how many jobs at once, whether the first
    failure stops the sweep, a job's time limit and its grace after SIGTERM."""

    max_parallel: int | None = None
    fail_fast: bool = False
    timeout_s: float | None = None
    kill_grace_s: float = 30.0

    def __post_init__(self) -> None:
        problem = max_parallel_problem(self.max_parallel)
        if problem:
            raise ConfigError(problem)


@dataclass(frozen=True)
class LocalSettings(SweepSettings):
    """The ddp launcher's: jobs as processes on this machine (:mod:`ddpexp.sweep.local`)."""

    # GPUs the sweep may use (None = all visible).
    gpus: int | None = None
    # Fork each job from one process that imported torch (false: a fresh interpreter each).
    fork: bool = True
    # Modules the fork server imports too.
    preload: tuple[str, ...] = ()


@dataclass(frozen=True)
class RaySettings(SweepSettings):
    """The ray launcher's: jobs on a Ray cluster (:mod:`ddpexp.sweep.ray_backend`)."""

    # auto, HOST:PORT, ray://HOST:PORT; None: a Ray of this machine for the sweep.
    address: str | None = None
    # Times a job whose node died is placed again.
    retries: int = 0
    # Bytes of the object store of the Ray the sweep starts (None: Ray's default).
    object_store_memory: int | None = None


S = TypeVar("S", bound=SweepSettings)


@dataclass
class Sweep:
    """One launcher's sweep as the driver and the ``optuna_async`` search see it: its
    settings, Hydra's set-up, the launcher's name for the log, and how to make its backend
    (a new one per call)."""

    settings: SweepSettings
    hydra: HydraSetup
    name: str
    make_backend: Callable[[], Backend]

    @classmethod
    def set_up(cls, settings: S, name: str, make_backend: Callable[[S, HydraSetup], Backend],
               hydra_context: HydraContext, task_function: TaskFunction,
               config: DictConfig) -> Sweep:
        """The sweep a launcher's ``setup()`` makes: ``make_backend`` gets its own settings."""
        hydra = HydraSetup(config, hydra_context, task_function)
        return cls(settings, hydra, name, lambda: make_backend(settings, hydra))

    def backend(self) -> Backend:
        """A new backend for the sweep's jobs (the driver and the search each ask once)."""
        return self.make_backend()


@runtime_checkable
class SweepLauncher(Protocol):
    """A launcher whose jobs ddpexp's driver runs (``hydra/launcher=ddp`` and ``ray``):
    its :class:`Sweep`, set once its ``setup()`` ran."""

    sweep: Sweep | None


@contextlib.contextmanager
def exit_message() -> Iterator[None]:
    """ddpexp's own error, raised while a launcher or sweeper runs the sweep, ends the command
    with its message alone and exit status 1, as a run's error does: raised on, Hydra would
    print its ``HYDRA_FULL_ERROR`` trailer after it. A sweep stopped by a signal ends the
    same way with 128 + the signal's number (130 for a Ctrl-C), as a shell reports a
    command that a signal ended. ``HYDRA_FULL_ERROR=1`` raises either on."""
    try:
        yield
    except (DdpexpError, SweepInterrupted) as exc:
        if os.environ.get("HYDRA_FULL_ERROR", "").lower() not in ("", "0", "false", "no"):
            raise
        name = getattr(exc, "signal_name", None)
        number = getattr(signal, str(name), None) if name else None
        if isinstance(exc, SweepInterrupted) and number is not None:
            sys.stdout.flush()
            print(str(exc), file=sys.stderr, flush=True)
            raise SystemExit(128 + int(number)) from None
        raise SystemExit(str(exc)) from None
