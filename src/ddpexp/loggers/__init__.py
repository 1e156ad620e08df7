"""The loggers seam: what records a run's metrics (TensorBoard, a CSV file, MLflow, a user's
own), built from the ``logger`` config group, a dict of entries keyed by name.

:func:`build_loggers` turns the entries into :class:`Logger` objects (global rank 0 only);
:func:`prepare_loggers` runs each one's class-level ``prepare`` once in the launching process.
A logger's class must subclass :class:`Logger`: the base class gives every call a do-nothing
default, so the trainer can make every call on every logger, and a misspelt method name in a
user's logger is not mistaken for a missing optional one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping

from ddpexp.errors import ConfigError, DdpexpError
from ddpexp.loggers.base import SUCCESS_STATUSES, Logger, RunInfo
from ddpexp.loggers.csv import CSVLogger
from ddpexp.loggers.mlflow import MLflowLogger
from ddpexp.loggers.tensorboard import TensorBoardLogger

__all__ = [
    "CSVLogger", "Logger", "MLflowLogger", "RunInfo", "SUCCESS_STATUSES", "TensorBoardLogger",
    "build_loggers", "prepare_loggers",
]


def _locate(path: str) -> Any:
    """The object a dotted ``path`` names (``pkg.module.Class``); ImportError or
    AttributeError say what is missing. A module that fails on a missing dependency of its own
    raises that error, not "no such module"."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (module_name + ".").startswith(exc.name + "."):
                continue
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module named {parts[0]!r}")


def logger_class(name: str, node: Any) -> type:
    """The :class:`Logger` subclass that entry ``logger.<name>`` names by ``_target_``, or one
    ConfigError that names the entry and what is wrong."""
    if not isinstance(node, Mapping) or not node.get("_target_"):
        raise ConfigError(
            f"logger.{name} has no _target_: name its class, e.g. "
            f"+logger.{name}._target_=mypkg.MyLogger (a subclass of ddpexp.loggers.Logger), "
            f"or remove the entry with ~logger.{name}")
    target = str(node["_target_"])
    try:
        cls = _locate(target)
    except Exception as exc:
        raise ConfigError(
            f"logger.{name}._target_={target} does not import ({type(exc).__name__}: {exc}); "
            "check the dotted path and that its package is installed") from exc
    if not (isinstance(cls, type) and issubclass(cls, Logger)):
        raise ConfigError(
            f"logger.{name}._target_={target} is not a logger: a logger is a class that "
            "subclasses ddpexp.loggers.Logger (and overrides open, log_metrics, finalize, ...)")
    return cls


def build_loggers(nodes: Mapping[str, dict]) -> dict[str, Logger]:
    """One logger per entry of the ``logger`` node, in its order, each built with
    ``hydra.utils.instantiate`` (its keys are the constructor's arguments, plain Python).
    Raises one ConfigError naming the entry for an entry without ``_target_``, a target that
    does not import, a class that is not a :class:`Logger`, or a constructor that fails."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    loggers: dict[str, Logger] = {}
    for name, node in (nodes or {}).items():
        logger_class(name, node)
        try:
            loggers[name] = instantiate(dict(node), _convert_="all")
        except InstantiationException as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, DdpexpError):
                raise ConfigError(f"logger.{name}: {cause}") from cause
            raise ConfigError(
                f"logger.{name} ({node['_target_']}) could not be built: "
                f"{type(cause).__name__}: {cause}") from cause
    return loggers


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
