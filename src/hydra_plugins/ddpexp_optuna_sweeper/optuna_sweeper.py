"""The Hydra ``Sweeper`` class: keeps its settings and the launcher, and leaves the search to
:mod:`ddpexp.sweep.search`, imported inside ``sweep()``, so that importing the plugin (which
Hydra does at every start of every app) imports neither optuna nor torch."""

from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaAsyncSweeper(Sweeper):
    """An Optuna search (ask/tell) on ddpexp's ``ddp`` launcher: a new trial starts the
    moment one of the launcher's ``max_parallel`` slots frees; trials report every epoch to
    the pruner; the study lives in the sweep dir and resumes with ``resume=auto``."""

    def __init__(self, n_trials: int = 20, direction: str | None = None,
                 study_name: str = "ddpexp", sampler: Any = None, pruner: Any = None,
                 params: Any | None = None) -> None:
        self.keys = {"n_trials": n_trials, "direction": direction, "study_name": study_name,
                     "sampler": dict(sampler or {}), "pruner": dict(pruner or {}),
                     "params": dict(params or {})}
        self.config: DictConfig | None = None
        self.launcher: Launcher | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from ddpexp.sweep import search
        from ddpexp.sweep.settings import exit_message

        if self.config is None or self.launcher is None:
            raise RuntimeError("the sweeper's sweep() ran before its setup()")
        with exit_message():
            return search.run(search.SearchSettings(**self.keys), self.config, self.launcher,
                              arguments)
