"""The logger contract: what a logger knows of its run (:class:`RunInfo`) and the calls made on
it (:class:`Logger`).

Only global rank 0 builds loggers, and it never calls one from the training loop: the loop
hands points to the logger's queue, and the logger's own writer thread
(:mod:`ddpexp.loggers.writer`) makes every call, in this order: ``load_state_dict(saved)``
(when resuming from a checkpoint that holds the logger's state), ``open(run)``,
``log_hparams(run.hparams)`` (fresh runs only), ``log_metrics(...)`` for the points of every
log step, epoch end and test, ``flush()`` once those are due, ``state_dict()`` after each
flush, and ``finalize(status)`` once at the end, also after an exception. ``prepare`` runs
once in the launching process, before any worker or sweep job starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpexp.errors import ConfigError
from ddpexp.record import FINISHED

# The statuses of a run that ended as intended.
SUCCESS_STATUSES = FINISHED


class StoreRefused(ConfigError):
    """A logger's store that cannot be used, raised by :meth:`Logger.prepare`: ``key`` is the
    entry's key that holds it (``tracking_uri``), ``value`` what it says, ``why`` the
    problem. :func:`ddpexp.loggers.prepare_loggers` names it ``logger.<name>.<key>``."""

    def __init__(self, key: str, value: str, why: str):
        super().__init__(f"{key}={value}: {why}")
        self.key, self.value, self.why = key, value, why


@dataclass
class RunInfo:
    """What a logger knows of the run it records."""

    # The run dir (or the sweep job's dir).
    run_dir: Path
    # Display name: the run dir relative to the outputs root, e.g. "2026-12-01/10-20-00" or
    # "multirun/2026-12-01/10-20-00/3".
    name: str
    # The resolved config, plain Python (nested dicts and lists).
    config: dict
    # The run's command-line overrides as {key: value} (what a sweep varies).
    hparams: dict
    # True when this session continues a checkpoint.
    resumed: bool
    # The last step stored: 0 when fresh; when resumed, the last step whose points this
    # logger acknowledged before the checkpoint (its points after that are sent again).
    step: int
    # The sweep dir of a sweep's job (what a tracker groups its jobs by); None for a run.
    sweep_dir: Path | None = None

    @property
    def outputs_root(self) -> Path:
        """The dir that holds every run (see :func:`outputs_root`)."""
        return outputs_root(self.run_dir)


def outputs_root(run_dir: Path) -> Path:
    """The dir that holds every run: the nearest ancestor of ``run_dir`` named ``outputs``
    (the default layout, ``outputs/D/T`` and ``outputs/multirun/D/T/3``), else the run dir's
    parent (a sweep's dir, for its jobs)."""
    run_dir = Path(run_dir).absolute()
    for parent in run_dir.parents:
        if parent.name == "outputs":
            return parent
    return run_dir.parent


def run_name(run_dir: Path) -> str:
    """A run's display name: its dir below :func:`outputs_root` (``2026-12-01/10-20-00``,
    ``multirun/2026-12-01/10-20-00/3``)."""
    run_dir = Path(run_dir).absolute()
    return run_dir.relative_to(outputs_root(run_dir)).as_posix()


class Logger:
    """Base class of every logger; a user's own logger subclasses it and is named by
    ``_target_`` under ``logger.<name>`` (its other keys are its constructor's arguments;
    ``flush_timeout_s`` is the writer's, set on the built logger).

    Every method has a do-nothing default, so a logger overrides only what it records.
    Values are plain Python. What a logger may assume about threads: it is built in the
    loop's thread, and from then on every method but :meth:`prepare` is called from one
    thread of its own, one call at a time, in the order the module docstring gives; so a
    logger needs no lock of its own, and a call that blocks (a tracker that does not answer)
    delays only this logger. A call that raises costs the points handed over since the last
    :meth:`flush` (counted, warned about, listed in metrics.json), never the run.
    """

    # Seconds the writer lets points wait, to hand them over and flush() them together.
    flush_every_s: float = 0.0
    # Points waiting that make the writer hand them over at once.
    flush_every_points: int = 1000
    # Seconds the end of a run waits for this logger to take what is queued and finish
    # (logger.<name>.flush_timeout_s); what it has not taken by then is lost.
    flush_timeout_s: float = 30.0

    def open(self, run: RunInfo) -> None:
        """Start recording ``run``: before the first step, after any resume state was loaded
        (``load_state_dict`` comes before ``open``). When ``run.resumed``, points with a step
        above ``run.step`` may already be stored (sent after the checkpoint, before the
        session ended): they will be logged again, and must not appear twice."""

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """The run's hyperparameters (its command-line overrides); fresh runs only."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """One point per name (``train/loss``, ``val/acc``, ``best/val/acc``, ``lr``, ...) at
        optimizer step ``step`` during epoch ``epoch``."""

    def flush(self) -> None:
        """Store what earlier ``log_metrics`` calls handed over. Once it returns, those points
        count as acknowledged: a checkpoint records them as stored, and a resume does not send
        them again. A logger that stores each point as it is logged leaves it as it is."""

    def finalize(self, status: str) -> None:
        """Called once at the end with the run's status (completed, early_stopped,
        interrupted, failed, diverged, pruned, stopped). Must also be safe after an
        exception, including one raised before or inside ``open``."""

    def state_dict(self) -> dict:
        """What a resumed session needs, saved in every checkpoint under ``loggers/<name>``:
        plain data only (str, int, float, bool, None, lists, dicts), which
        ``torch.load(weights_only=True)`` reads."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned, before :meth:`open` of a resumed run."""

    @classmethod
    def record_refusal(cls, node: dict, run: RunInfo, error: str) -> None:
        """A sweep job refused before training (by its config or the machine's resources),
        in the job's process: record it where ``run`` would have been recorded (MLflow: a
        run marked FAILED, ``error`` as a tag), so that a tracker lists every job. It should
        take seconds; the default records nothing."""

    @classmethod
    def prepare(cls, node: dict, outputs_root: Path) -> None:
        """Runs once in the launching process before any worker or sweep job starts (e.g. to
        create a database schema that concurrent jobs then share, or to refuse a store that
        cannot be used, with :class:`StoreRefused`); ``node`` is this logger's config entry
        (``_target_`` included), ``outputs_root`` the dir that holds every run. It should
        take seconds, not minutes: the run waits for it."""
