"""The seam between a sweep's driver and the engine that runs its jobs.

The driver (:mod:`ddpexp.sweep.driver`) owns what every engine shares: each job's config and
dir, the ``resume=auto`` checks, ``fail_fast``, ``timeout_s``, Ctrl-C/SIGTERM, what a job's
ending means and the summary. A :class:`Backend` owns only where and how a job runs: it says
whether there is room for another job, starts one, reports the jobs that ended and stops a
job when the driver asks. ddpexp's own is :class:`ddpexp.sweep.local.LocalBackend` (each job
a process on its own slice of this machine's cores and GPUs).

A launcher hands the driver its :class:`~ddpexp.sweep.settings.Sweep`: its typed settings,
Hydra's set-up and how to make its backend; the driver's batch
:func:`ddpexp.sweep.driver.launch` and the ``optuna_async`` search run on any such sweep.
"""

from __future__ import annotations

import json
import pickle
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import CompactHydraException
from omegaconf import DictConfig

from ddpexp.config.commands import SWEEP_COMMAND_ENV, sweep_command
from ddpexp.record import JOB_STARTED_ENV
from ddpexp.runtime.jobtag import JOB_TAG_ENV
from ddpexp.sweep.compose import Composer

if TYPE_CHECKING:
    from hydra.types import HydraContext, TaskFunction


@dataclass
class HydraSetup:
    """What Hydra hands a launcher's ``setup()``, and the outcomes of every ``launch()`` call
    of the sweep (some sweepers launch in batches) by job subdir, so that a job that left no
    ``metrics.json`` still gets its row and cause in the summary."""

    config: DictConfig
    hydra_context: HydraContext
    task_function: TaskFunction
    outcomes: dict = field(default_factory=dict)
    composer: Composer | None = field(default=None, repr=False, compare=False)

    def compose(self, overrides: list[str]) -> DictConfig:
        """The config of the sweep's job with these overrides, as Hydra composes it
        (:class:`ddpexp.sweep.compose.Composer`: most jobs of a sweep are copies)."""
        if self.composer is None:
            self.composer = Composer(self.hydra_context.config_loader, self.config)
        return self.composer.compose(overrides)



class JobFailed(CompactHydraException):
    """A job ended without a result (killed, timed out, crashed before reporting)."""


class JobSkipped(CompactHydraException):
    """A job not started because an earlier one failed and ``fail_fast`` is set."""


class SweepInterrupted(CompactHydraException):
    """SIGTERM/SIGINT stopped the sweep; the message says how to resume it. ``signal_name``
    is the signal the sweep got (the user's: SIGINT for a Ctrl-C), whose number the command
    exits with as a shell reports it (128 + signal, :func:`ddpexp.sweep.settings.exit_message`)."""

    def __init__(self, message: str, signal_name: str | None = None):
        super().__init__(message)
        self.signal_name = signal_name


class _Packed:
    """A field of :class:`PackedReturn`, kept pickled and compressed: each read unpickles a
    fresh copy, which the reader lets go of."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = f"_packed_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return None  # the dataclass default, where one is asked for
        packed = obj.__dict__.get(self.key)
        return None if packed is None else pickle.loads(zlib.decompress(packed))

    def __set__(self, obj: Any, value: Any) -> None:
        if value is None:
            obj.__dict__[self.key] = None
            return
        # cloudpickle: a config the job's process sent holds classes rebuilt by value.
        import cloudpickle

        obj.__dict__[self.key] = zlib.compress(cloudpickle.dumps(value), 1)


class PackedReturn(JobReturn):
    """A JobReturn that keeps its ``cfg`` and ``hydra_cfg`` as a few KiB of bytes. Hydra's
    launcher contract hands every job's return, configs included, back to the sweeper at
    the sweep's end; held as objects (about 160 KiB each) they grew the launcher's memory
    with every job of the sweep."""

    # Descriptors over JobReturn's fields: a read gives the DictConfig (or None) back.
    cfg = _Packed()  # pyright: ignore[reportAssignmentType]
    hydra_cfg = _Packed()  # pyright: ignore[reportAssignmentType]

    @classmethod
    def of(cls, ret: JobReturn) -> PackedReturn:
        return ret if isinstance(ret, PackedReturn) else cls(
            overrides=ret.overrides, cfg=ret.cfg, hydra_cfg=ret.hydra_cfg,
            working_dir=ret.working_dir, task_name=ret.task_name, status=ret.status,
            _return_value=ret._return_value)


@dataclass
class Job:
    """One sweep job, from its overrides to its JobReturn: what the driver knows of it, plus
    ``handle``, the backend's own record of the job it started (a process, a remote task)."""

    idx: int
    overrides: list[str]
    # Composed by the driver; let go once the job has ended (a sweep of many jobs would
    # otherwise hold every job's config, and its result's copies, to the end).
    config: DictConfig | None = None
    dir: Path | None = None
    # Its dir under the sweep dir (hydra.sweep.subdir, as composed): its row in the table.
    subdir: str | None = None
    # ``config`` pickled and compressed while the job waits for its turn (see pack()).
    packed: bytes | None = None
    gpus: int = 0
    # Its run's worker processes on one machine: a core each when the local backend packs.
    workers: int = 1
    ret: JobReturn | None = None
    # Extra environment of the job process (its workers inherit it).
    env: dict[str, str] = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0
    handle: Any = None
    # Set by the driver while it stops the job: since when, why, and what it last sent.
    stopping_since: float | None = None
    timed_out: bool = False
    # The last signal the driver asked for because the sweep was stopped (SIGTERM, SIGKILL).
    stop_signal: str | None = None
    # The signal that interrupted the job (it ended without failing), once it has ended.
    interrupted_by: str | None = None

    def pack(self) -> None:
        """Keep the config as a few KiB of bytes until the job starts (a sweep composes every
        job before the first starts; 500 configs held as objects are 80 MB)."""
        if self.config is not None:
            self.packed = zlib.compress(pickle.dumps(self.config), 1)
            self.config = None

    def unpack(self) -> None:
        """The config as it was composed, before the job starts."""
        if self.packed is not None:
            self.config = pickle.loads(zlib.decompress(self.packed))
            self.packed = None

    @property
    def label(self) -> str:
        return f"#{self.idx} : {' '.join(filter_overrides(self.overrides))}"

    @property
    def outcome(self) -> str:
        """How the job ended, as its summary row says: completed, failed, interrupted or
        not run."""
        assert self.ret is not None, "the job has not ended"
        if self.ret.status == JobStatus.COMPLETED:
            return "completed"
        if self.interrupted_by is not None:
            return "interrupted"
        return "not run" if isinstance(self.ret._return_value, JobSkipped) else "failed"


@dataclass
class Ended:
    """A job that a backend saw end."""

    job: Job
    # What the job reported (Hydra's run_job result); None when it reported nothing.
    ret: JobReturn | None
    # With no report: how it ended, as the end of "job N: ...", e.g. "its process was killed
    # by SIGKILL" or "its process exited with code 1 without a result".
    why: str = ""
    # The signal its process ended by, where the backend knows (interruptions name it).
    signal: str | None = None


class Backend(ABC):
    """Where and how a sweep's jobs run. The driver calls, in this order: :meth:`prepare`
    (optional), ``with backend:``, then :meth:`start`, :meth:`wait` and :meth:`stop` as jobs
    come and go. A backend never decides whether a job should run, or what its ending means:
    it starts what it is given where there is room, and reports what it saw."""

    def prepare(self) -> None:  # noqa: B027  # optional: most backends have nothing to begin early
        """Begin slow set-up in the background (called before the driver composes the jobs,
        so the two overlap); ``__enter__`` completes it. Nothing by default."""

    def __enter__(self) -> Self:
        """Set up what running jobs needs (a scratch dir, a server, a connection)."""
        return self

    def __exit__(self, *exc: Any) -> None:  # noqa: B027  # optional: nothing to tear down by default
        """Tear it down. Called with jobs still running only when the driver failed: nothing
        of those jobs may outlive the sweep."""

    @abstractmethod
    def describe(self) -> str:
        """How many jobs run at once, for the sweep's first log line."""

    @property
    @abstractmethod
    def free(self) -> int:
        """Room for another job now (0: none). A job may still not fit (it needs GPUs that
        are busy): :meth:`start` says."""

    @abstractmethod
    def start(self, job: Job) -> bool:
        """Start ``job`` (its config, dir and env are set): set ``job.started`` and keep what
        :meth:`wait` and :meth:`stop` need in ``job.handle``; False, with nothing started,
        when it does not fit now."""

    @abstractmethod
    def wait(self, timeout: float) -> list[Ended]:
        """The started jobs that ended since the last call, waiting up to ``timeout``
        seconds for one; empty when none did. An ended job holds nothing of the backend's
        any more (its room is free again, nothing it started still runs)."""

    @abstractmethod
    def stop(self, job: Job, force: bool = False) -> None:
        """Stop a running job: by default as SIGTERM does (ddpexp saves a checkpoint and
        exits), ``force`` at once with everything it started, as SIGKILL. The driver asks
        again after ``hydra.launcher.kill_grace_s`` with ``force``, and may repeat it; the
        job is reported by :meth:`wait` as any other."""


def payload(hydra: HydraSetup, job: Job) -> dict[str, Any]:
    """What a job's process needs to run it with Hydra's ``run_job`` (as Hydra's submitit
    launcher ships it): the task function, the job's sweep config, the Hydra context and
    Hydra's Singleton state (config store, resolvers). See :mod:`ddpexp.sweep.job`."""
    return {
        "task_function": hydra.task_function,
        "config": job.config,
        "hydra_context": hydra.hydra_context,
        "singleton_state": Singleton.get_state(),
    }


def job_env(job: Job) -> dict[str, str]:
    """The variables a job's process adds to its environment: the job's own (a trial's
    identity), when it started (its run counts its wall time from ``job.started``, the
    process's start-up included), the tag of its console lines (``#N``, as :attr:`Job.label`
    names it) and the sweep's command (what "continue it with" repeats)."""
    env = {**job.env, JOB_STARTED_ENV: repr(job.started), JOB_TAG_ENV: f"#{job.idx}"}
    command = sweep_command()
    if command is not None:
        env[SWEEP_COMMAND_ENV] = json.dumps(command)
    return env
