"""The ``ray`` launcher (``hydra/launcher=ray``): the sweep driver (:mod:`ddpexp.sweep.driver`)
on the Ray backend (:mod:`ddpexp.sweep.ray_backend`), every job a ddpexp run on a node of a
Ray cluster. Ray is imported by the backend when a sweep begins, never by this module: Hydra
imports the plugin at every start of every app, and Ray is an optional extra."""

from typing import Any

# The module, not its class: Hydra's plugin scan registers every plugin class a module
# holds, and the ddp launcher is registered by its own module.
from hydra_plugins.ddpexp_launcher import ddp_launcher


class RayLauncher(ddp_launcher.DdpLauncher):
    """Runs each sweep job on a Ray cluster, as soon as a node has its workers' CPUs (and
    GPUs) free, and summarises the sweep as the ddp launcher does."""

    def __init__(self, address: str | None = None, max_parallel: int | None = None,
                 fail_fast: bool = False, timeout_s: float | None = None,
                 kill_grace_s: float = 30.0, retries: int = 0,
                 object_store_memory: int | None = None) -> None:
        super().__init__(max_parallel=max_parallel, fail_fast=fail_fast, timeout_s=timeout_s,
                         kill_grace_s=kill_grace_s)
        self.address = address
        self.retries = retries
        self.object_store_memory = object_store_memory

    def backend(self) -> Any:
        """The Ray backend (a new one per call); Ray must be installed (the ``ray`` extra)."""
        try:
            import ray  # noqa: F401
        except ImportError:
            from ddpexp.errors import ConfigError

            raise ConfigError("hydra/launcher=ray needs Ray: pip install -e \".[ray]\" (or "
                              "pip install 'ray>=2.60')") from None
        from ddpexp.sweep.ray_backend import RayBackend

        return RayBackend(self)
