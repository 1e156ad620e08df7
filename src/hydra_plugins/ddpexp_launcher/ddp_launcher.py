"""The Hydra ``Launcher`` class: stores its config in ``setup()`` and leaves the work to
:mod:`ddpexp.sweep.driver` on the local backend (:mod:`ddpexp.sweep.local`), both imported
inside its methods, so that importing the plugin (which Hydra does at every start of every
app) imports neither torch nor anything heavy."""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

if TYPE_CHECKING:
    from ddpexp.sweep.backend import Backend


class DdpLauncher(Launcher):
    """Runs each sweep job as its own process (which fans out its own DDP workers), as many
    at once as the machine holds (``max_parallel: null``) or ``max_parallel`` at a time on
    equal slices of the machine, and summarises the sweep."""

    def __init__(self, max_parallel: int | None = None, fail_fast: bool = False,
                 gpus: int | None = None, timeout_s: float | None = None,
                 kill_grace_s: float = 30.0, fork: bool = True,
                 preload: Sequence[str] | None = None) -> None:
        self.max_parallel = max_parallel
        self.fail_fast = fail_fast
        self.gpus = gpus
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.fork = fork
        self.preload = list(preload or [])
        # Outcomes of every launch() call of this sweep (some sweepers launch in batches), by
        # job subdir: a job that left no metrics.json still gets its row and cause.
        self.outcomes: dict = {}
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        """Keep the sweep's config; refuse launcher settings that cannot work before the
        sweep writes anything."""
        check_settings(self)
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def backend(self) -> "Backend":
        """Where the jobs run: as processes on this machine's slices (a new backend per
        call; the driver and the ``optuna_async`` search ask for one)."""
        from ddpexp.sweep.local import LocalBackend

        return LocalBackend(self)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ddpexp.sweep import driver

        return driver.launch(self, job_overrides=job_overrides, initial_job_idx=initial_job_idx)


def check_settings(launcher: DdpLauncher) -> None:
    """Refuse ``hydra.launcher.*`` values that cannot work, with one message: a
    ``max_parallel`` below 1 would run nothing, or quietly one job at a time. (A value typed
    on the command line is refused before Hydra starts: ddpexp.config.cli.preflight.)"""
    from ddpexp.config.cli import max_parallel_problem
    from ddpexp.errors import ConfigError

    problem = max_parallel_problem(launcher.max_parallel)
    if problem:
        raise ConfigError(problem)
