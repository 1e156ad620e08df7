"""The loggers seam: what records a run's metrics (TensorBoard, a CSV file, MLflow, a user's
own), built from the ``logger`` config group, a dict of entries keyed by name.

:func:`build_loggers` turns the entries into :class:`Logger` objects (global rank 0 only);
:func:`prepare_loggers` runs each one's class-level ``prepare`` once in the launching process.
A logger's class must subclass :class:`Logger`: the base class gives every call a do-nothing
default, so the trainer can make every call on every logger, and a misspelt method name in a
user's logger is not mistaken for a missing optional one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ddpexp.config import components
from ddpexp.errors import ConfigError, DdpexpError
from ddpexp.loggers.base import SUCCESS_STATUSES, Logger, RunInfo, outputs_root, run_name
from ddpexp.loggers.csv import CSVLogger
from ddpexp.loggers.mlflow import MLflowLogger
from ddpexp.loggers.tensorboard import TensorBoardLogger

__all__ = [
    "CSVLogger", "Logger", "MLflowLogger", "RunInfo", "SUCCESS_STATUSES", "TensorBoardLogger",
    "build_loggers", "outputs_root", "prepare_loggers", "run_name",
]


def logger_class(name: str, node: Any) -> type:
    """The :class:`Logger` subclass that entry ``logger.<name>`` names by ``_target_``, or one
    ConfigError that names the entry and what is wrong."""
    return components.locate("logger", name, node, Logger)


def build_loggers(nodes: Mapping[str, dict]) -> dict[str, Logger]:
    """One logger per entry of the ``logger`` node, in its order, each built with
    ``hydra.utils.instantiate`` (its keys are the constructor's arguments). One ConfigError
    naming the entry for an entry without ``_target_``, a target that does not import, a
    class that is not a :class:`Logger`, or a constructor that fails."""
    return components.build("logger", nodes, Logger)


def prepare_loggers(nodes: Mapping[str, dict], outputs_root: Path) -> None:
    """Each entry's ``prepare(node, outputs_root)``, once, in the launching process before any
    worker or sweep job starts; a failure is one ConfigError naming the entry."""
    for name, node in (nodes or {}).items():
        cls = logger_class(name, node)
        try:
            cls.prepare(dict(node), Path(outputs_root))
        except DdpexpError as exc:
            raise ConfigError(f"logger.{name}: {exc}") from exc
        except Exception as exc:
            raise ConfigError(
                f"logger.{name} ({node['_target_']}) could not prepare its store: "
                f"{type(exc).__name__}: {exc}") from exc
