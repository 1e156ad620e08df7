"""The ``ray`` launcher (``hydra/launcher=ray``): the sweep driver (:mod:`ddpexp.sweep.driver`)
on the Ray backend (:mod:`ddpexp.sweep.ray_backend`), every job a ddpexp run on a node of a
Ray cluster. Ray is imported by the backend when a sweep begins, never by this module: Hydra
imports the plugin at every start of every app, and Ray is an optional extra."""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

if TYPE_CHECKING:
    from ddpexp.sweep.backend import Backend, HydraSetup
    from ddpexp.sweep.settings import RaySettings, Sweep


class RayLauncher(Launcher):
    """Runs each sweep job on a Ray cluster, as soon as a node has its workers' CPUs (and
    GPUs) free, and summarises the sweep as the ddp launcher does."""

    # Set by setup(): what the driver and the optuna_async search run on.
    sweep: "Sweep | None" = None

    def __init__(self, address: str | None = None, max_parallel: int | None = None,
                 fail_fast: bool = False, timeout_s: float | None = None,
                 kill_grace_s: float = 30.0, retries: int = 0,
                 object_store_memory: int | None = None) -> None:
        self.keys = {"address": address, "max_parallel": max_parallel, "fail_fast": fail_fast,
                     "timeout_s": timeout_s, "kill_grace_s": kill_grace_s, "retries": retries,
                     "object_store_memory": object_store_memory}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        """The sweep's typed settings (values that cannot work are refused here, before the
        sweep writes anything) and Hydra's set-up."""
        from ddpexp.sweep.settings import RaySettings, Sweep, exit_message

        with exit_message():
            settings = RaySettings(**self.keys)
            if settings.address is not None:
                # Before the sweep dir is made: a cluster that does not answer leaves none.
                from ddpexp.sweep.ray_cluster import probe

                probe(settings.address)
            self.sweep = Sweep.set_up(settings, "ray", self.make_backend, hydra_context,
                                      task_function, config)

    def make_backend(self, settings: "RaySettings", hydra: "HydraSetup") -> "Backend":
        """The Ray backend; Ray must be installed (the ``ray`` extra)."""
        try:
            import ray  # noqa: F401
        except ImportError:
            from ddpexp.errors import ConfigError

            raise ConfigError("hydra/launcher=ray needs Ray: pip install -e \".[ray]\" (or "
                              "pip install 'ray>=2.60')") from None
        from ddpexp.sweep.ray_backend import RayBackend

        return RayBackend(settings, hydra)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ddpexp.sweep import driver
        from ddpexp.sweep.settings import exit_message

        with exit_message():
            return driver.launch(self.sweep, job_overrides, initial_job_idx)
