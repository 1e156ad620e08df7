"""The resolved config for a trainer built in this process (tests and measurements)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hydra import compose, initialize_config_module
from hydra.core.singleton import Singleton
from hydra.version import VersionBase
from omegaconf import open_dict

from ddpexp.config.monitor import fill_monitor
from ddpexp.config.schema import register_configs, to_plain


def compose_single_process(overrides: list[str], config_dir: Optional[Path] = None) -> dict:
    """The resolved config (plain Python, as a worker receives it) for ``overrides``, for a
    trainer built in this process: one process (``strategy=single``), the task's monitor
    filled in as a run's parent does. ``config_dir`` is a user's own config dir
    (``--config-dir``). For tests and measurements that build the trainer directly."""
    register_configs()
    extra = [f"hydra.searchpath=[file://{config_dir}]"] if config_dir else []
    try:
        with initialize_config_module(version_base="1.3", config_module="ddpexp.conf"):
            cfg = compose("config", overrides=[*overrides, *extra])
    finally:
        # initialize_* leaves its version base in a process-wide singleton; Hydra's launcher
        # plugins, run later in the same process, expect the unspecified (pre-1.2) default.
        Singleton._instances.pop(VersionBase, None)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    plain = to_plain(cfg)
    plain["trainer"]["strategy"] = "single"
    fill_monitor(plain)
    return plain
