"""The Hydra ``Launcher`` class of ``hydra/launcher=ddp``: turns its keys into typed settings
in ``setup()`` and leaves the work to :mod:`ddpexp.sweep.driver` on the local backend
(:mod:`ddpexp.sweep.local`), both imported inside its methods, so that importing the plugin
(which Hydra does at every start of every app) imports neither torch nor anything heavy."""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

if TYPE_CHECKING:
    from ddpexp.sweep.backend import Backend, HydraSetup
    from ddpexp.sweep.settings import LocalSettings, Sweep


class DdpLauncher(Launcher):
    """Runs each sweep job as its own process (which fans out its own DDP workers), as many
    at once as the machine holds (``max_parallel: null``) or ``max_parallel`` at a time on
    equal slices of the machine, and summarises the sweep."""

    # Set by setup(): what the driver and the optuna_async search run on.
    sweep: "Sweep | None" = None

    def __init__(self, max_parallel: int | None = None, fail_fast: bool = False,
                 gpus: int | None = None, timeout_s: float | None = None,
                 kill_grace_s: float = 30.0, fork: bool = True,
                 preload: Sequence[str] | None = None) -> None:
        self.keys = {"max_parallel": max_parallel, "fail_fast": fail_fast, "gpus": gpus,
                     "timeout_s": timeout_s, "kill_grace_s": kill_grace_s, "fork": fork,
                     "preload": tuple(preload or ())}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        """The sweep's typed settings (values that cannot work are refused here, before the
        sweep writes anything) and Hydra's set-up."""
        from ddpexp.sweep.settings import LocalSettings, Sweep, exit_message

        with exit_message():
            self.sweep = Sweep.set_up(LocalSettings(**self.keys), "ddp", self.make_backend,
                                      hydra_context, task_function, config)

    def make_backend(self, settings: "LocalSettings", hydra: "HydraSetup") -> "Backend":
        """Where the jobs run: as processes on this machine's slices."""
        from ddpexp.sweep.local import LocalBackend

        return LocalBackend(settings, hydra)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ddpexp.sweep import driver
        from ddpexp.sweep.settings import exit_message

        with exit_message():
            return driver.launch(self.sweep, job_overrides, initial_job_idx)
