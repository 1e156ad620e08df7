"""The loggers seam: what records a run's metrics (TensorBoard, a CSV file, MLflow, W&B, a
user's own), built from the ``logger`` config group, a dict of entries keyed by name.

:func:`build_loggers` turns the entries into :class:`Logger` objects (global rank 0 only);
:func:`prepare_loggers` runs each one's class-level ``prepare`` once in the launching process.
A logger's class must subclass :class:`Logger`: the base class gives every call a do-nothing
default, so the trainer can make every call on every logger, and a misspelt method name in a
user's logger is not mistaken for a missing optional one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpexp.config import components
from ddpexp.errors import ConfigError, DdpexpError
from ddpexp.loggers.base import (
    SUCCESS_STATUSES,
    Logger,
    RunInfo,
    StoreRefused,
    outputs_root,
    run_name,
)
from ddpexp.loggers.csv import CSVLogger
from ddpexp.loggers.mlflow import MLflowLogger
from ddpexp.loggers.tensorboard import TensorBoardLogger
from ddpexp.loggers.wandb import WandbLogger

__all__ = [
    "CSVLogger", "Logger", "MLflowLogger", "RunInfo", "SUCCESS_STATUSES", "StoreRefused",
    "TensorBoardLogger", "WandbLogger",
    "build_loggers", "outputs_root", "prepare_loggers", "record_refusal", "run_name",
]

log = logging.getLogger("ddpexp")

# The key of every entry that is its writer's, not its constructor's.
FLUSH_TIMEOUT = "flush_timeout_s"


def logger_class(name: str, node: Any) -> type:
    """The :class:`Logger` subclass that entry ``logger.<name>`` names by ``_target_``, or one
    ConfigError that names the entry and what is wrong."""
    return components.locate("logger", name, node, Logger)


def build_loggers(nodes: Mapping[str, dict]) -> dict[str, Logger]:
    """One logger per entry of the ``logger`` node, in its order, each built with
    ``hydra.utils.instantiate`` (its keys are the constructor's arguments, but for
    ``flush_timeout_s``, which is set on the built logger for its writer). One ConfigError
    naming the entry for an entry without ``_target_``, a target that does not import, a
    class that is not a :class:`Logger`, a constructor that fails, or a bad
    ``flush_timeout_s``."""
    nodes = {name: node for name, node in (nodes or {}).items() if node is not None}
    timeouts = {name: _flush_timeout(name, node) for name, node in nodes.items()}
    own = {name: {k: v for k, v in dict(node).items() if k != FLUSH_TIMEOUT}
           for name, node in nodes.items()}
    built = components.build("logger", own, Logger)
    for name, logger in built.items():
        if timeouts[name] is not None:
            logger.flush_timeout_s = timeouts[name]
    return built


def _flush_timeout(name: str, node: Any) -> float | None:
    """``logger.<name>.flush_timeout_s`` as seconds (None where the entry has none)."""
    value = node.get(FLUSH_TIMEOUT) if isinstance(node, Mapping) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"logger.{name}.{FLUSH_TIMEOUT}={value!r} must be a number of "
                          "seconds >= 0 (how long the end of a run waits for this logger)")
    return float(value)


def prepare_loggers(nodes: Mapping[str, dict], outputs_root: Path) -> None:
    """Each entry's ``prepare(node, outputs_root)``, once, in the launching process before any
    worker or sweep job starts; a failure is one ConfigError naming the entry (a refused
    store: the key that holds it, ``logger.<name>.tracking_uri=...``)."""
    for name, node in (nodes or {}).items():
        cls = logger_class(name, node)
        try:
            cls.prepare(dict(node), Path(outputs_root))
        except StoreRefused as exc:
            raise StoreRefused(f"logger.{name}.{exc.key}", exc.value, exc.why) from None
        except DdpexpError as exc:
            raise ConfigError(f"logger.{name}: {exc}") from exc
        except Exception as exc:
            raise ConfigError(
                f"logger.{name} ({node['_target_']}) could not prepare its store: "
                f"{type(exc).__name__}: {exc}") from exc


def record_refusal(nodes: Mapping[str, Any], run_dir: Path, config: dict, hparams: dict,
                   error: str) -> None:
    """Each entry's ``record_refusal``, for a sweep job refused before training (its
    config, its resources); a logger that cannot record it costs a warning, never the
    job's own error."""
    run = RunInfo(run_dir=Path(run_dir), name=run_name(run_dir), config=config,
                  hparams=hparams, resumed=False, step=0)
    for name, node in (nodes or {}).items():
        try:
            logger_class(name, node).record_refusal(dict(node), run, error)
        except Exception as exc:
            log.warning("logger.%s could not record the refusal: %s", name,
                        " ".join(str(exc).split())[:300])
