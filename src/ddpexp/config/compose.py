"""The resolved config for a trainer built in this process (tests and measurements)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.singleton import Singleton
from hydra.version import VersionBase
from omegaconf import DictConfig, open_dict

from ddpexp.config.monitor import with_monitor
from ddpexp.config.schema import register_configs, to_plain


def composed(overrides: list[str], config_dir: Path | str | None = None) -> DictConfig:
    """The config Hydra composes for ``overrides`` (interpolations unresolved, no ``hydra``
    node), without a run: nothing is written, and Hydra's process-wide state is as before.
    ``config_dir`` is a user's own config dir (``--config-dir``)."""
    register_configs()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).absolute()}]"] if config_dir else []
    version = Singleton._instances.get(VersionBase)
    try:
        with initialize_config_module(version_base="1.3", config_module="ddpexp.conf"):
            return compose("config", overrides=[*overrides, *extra])
    finally:
        # initialize_* leaves its version base in a process-wide singleton: put back the one
        # set before (by ``@hydra.main``, which runs next), or none.
        Singleton._instances.pop(VersionBase, None)
        if version is not None:
            Singleton._instances[VersionBase] = version


def compose_single_process(overrides: list[str], config_dir: Path | None = None) -> dict:
    """The resolved config (plain Python, as a worker receives it) for ``overrides``, for a
    trainer built in this process: one process (``strategy=single``), the task's monitor
    filled in as a run's parent does. ``config_dir`` is a user's own config dir
    (``--config-dir``). For tests and measurements that build the trainer directly."""
    cfg = composed(overrides, config_dir)
    # The launcher plugins that tests run later in this process expect the unspecified
    # (pre-1.2) version base, whatever was set before.
    Singleton._instances.pop(VersionBase, None)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    plain = to_plain(cfg)
    plain["trainer"]["strategy"] = "single"
    return with_monitor(plain)
