"""The ``ddp`` launcher's config, registered under ``hydra/launcher``."""

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class DdpLauncherConf:
    """``hydra.launcher.*`` keys of the ddp launcher."""

    _target_: str = "hydra_plugins.ddpexp_launcher.ddp_launcher.DdpLauncher"
    # Sweep jobs run at once, each on its own slice of the GPUs (or CPU cores).
    max_parallel: int = 1
    # Stop launching new jobs after the first failure (the jobs already running finish).
    fail_fast: bool = False
    # GPUs the sweep may use (null = all visible); each job takes trainer.gpus of them.
    gpus: Optional[int] = None


ConfigStore.instance().store(group="hydra/launcher", name="ddp", node=DdpLauncherConf,
                             provider="ddpexp")
