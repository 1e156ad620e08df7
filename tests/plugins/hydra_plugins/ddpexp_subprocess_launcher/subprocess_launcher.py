"""``hydra/launcher=subprocess``: the ddp launcher's keys and driver, its jobs run by
:class:`subprocess_backend.SubprocessBackend` instead of the local backend."""

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

# The modules, not their classes: Hydra's plugin scan registers every plugin class a module
# holds, and the ddp launcher is registered by its own module.
from hydra_plugins.ddpexp_launcher import config as ddp_config
from hydra_plugins.ddpexp_launcher import ddp_launcher


@dataclass
class SubprocessLauncherConf(ddp_config.DdpLauncherConf):
    _target_: str = "hydra_plugins.ddpexp_subprocess_launcher.subprocess_launcher.SubprocessLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="subprocess",
                             node=SubprocessLauncherConf, provider="ddpexp-tests")


class SubprocessLauncher(ddp_launcher.DdpLauncher):
    """The ddp launcher whose jobs are each a plain ``python -m ddpexp``."""

    def make_backend(self, settings: Any, hydra: Any) -> Any:
        from subprocess_backend import SubprocessBackend

        return SubprocessBackend(settings)
