"""The names ``trainer.strategy`` may take, and the class each one means.

A built-in strategy is registered here by its class's dotted path, so that the launching
process can ask a strategy what it needs (a process group, one process only, sharded
state) by importing that strategy's module alone: nothing here imports torch. A user's own
strategy needs no registration: ``trainer.strategy`` names its class by dotted path
(``trainer.strategy=mypkg.MyDDP``) or as a node with ``_target_``
(``trainer.strategy={_target_: mypkg.MyDDP}``, any other keys of the node being keyword
arguments of its constructor); :func:`register` gives one a short name as well.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ddpexp.errors import ConfigError

if TYPE_CHECKING:
    from ddpexp.strategies.base import Strategy

# Resolved by the launching process once the world size is known (:func:`resolve_auto`).
AUTO = "auto"

# name -> dotted path of the class (imported on first use), or the class itself.
_REGISTRY: dict[str, str | type[Strategy]] = {
    "ddp": "ddpexp.strategies.ddp.DDP",
    "fsdp": "ddpexp.strategies.fsdp.FSDP",
    "dp": "ddpexp.strategies.dp.DataParallel",
    "single": "ddpexp.strategies.base.Local",
}


def register(name: str, target: str | type[Strategy]) -> None:
    """Make ``trainer.strategy=name`` mean ``target``: a :class:`Strategy` subclass, or
    its dotted path (imported when the name is first used)."""
    if "." in name or name == AUTO:
        raise ValueError(f"a strategy's name has no dot and is not {AUTO!r}: {name!r}")
    _REGISTRY[name] = target


def names() -> list[str]:
    """What ``trainer.strategy`` accepts by name, ``auto`` first."""
    return [AUTO, *_REGISTRY]


def is_builtin(spec: Any) -> bool:
    """Whether ``spec`` is ``auto`` or a name registered here rather than a class of the
    user's own (by dotted path or ``_target_`` node)."""
    return isinstance(spec, str) and (spec == AUTO or spec in _REGISTRY)


def is_auto(spec: Any) -> bool:
    """Whether ``spec`` leaves the choice to :func:`resolve_auto`."""
    return isinstance(spec, str) and spec == AUTO


def resolve_auto(world_size: int, launched_elsewhere: bool = False) -> str:
    """What ``trainer.strategy=auto`` runs for ``world_size`` workers in all: DDP for
    several, or for ranks that another launcher (torchrun, SLURM, MPI) started, whatever
    their number; else one process."""
    return "ddp" if world_size > 1 or launched_elsewhere else "single"


def strategy_class(spec: Any, world_size: int = 1) -> type[Strategy]:
    """The class that ``trainer.strategy`` = ``spec`` names: a registered name, a dotted
    class path, or a node with ``_target_``. The launching process resolves ``auto``; a
    trainer built without it resolves it for its ``world_size``."""
    from ddpexp.strategies.base import Strategy

    target, _ = _split(spec)
    if target == AUTO:
        target = resolve_auto(world_size)
    entry = target if "." in target else _REGISTRY.get(target, target)
    if not isinstance(entry, str):
        return entry
    if "." not in entry:
        raise ConfigError(
            f"trainer.strategy: Invalid value {target!r}, expected one of [{', '.join(names())}], "
            "or a strategy class by its dotted path (trainer.strategy=mypkg.MyStrategy)")
    cls = _import(entry)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"trainer.strategy={entry} is not a strategy: name a subclass of "
                          "ddpexp.strategies.Strategy (e.g. of ddpexp.strategies.DDP)")
    return cls


def tensor_parallel_class(cls: type[Strategy]) -> type[Strategy] | None:
    """The strategy that runs a run of ``cls`` at ``trainer.tp > 1``: the class its
    ``tensor_parallel`` names (``ddp``: :class:`~ddpexp.strategies.tp.TensorParallel`;
    ``fsdp``: itself, on a 2-D mesh), or ``cls`` itself where it is a subclass of that class.
    None where it cannot, a subclass of ``ddp`` among them (its own code would not run)."""
    path = cls.tensor_parallel
    if path is None:
        return None
    target = _import(path)
    if issubclass(cls, target):
        return cls
    return target if vars(cls).get("tensor_parallel") == path else None


def kwargs_of(spec: Any) -> dict[str, Any]:
    """The keyword arguments a ``{_target_: ..., key: value}`` node gives its class."""
    return _split(spec)[1]


def label(spec: Any) -> str:
    """``spec`` as messages name it: the registered name, or the class's dotted path."""
    return _split(spec)[0]


def _split(spec: Any) -> tuple[str, dict[str, Any]]:
    """(name or dotted path, keyword arguments) of a ``trainer.strategy`` value."""
    if isinstance(spec, Mapping):
        rest = {str(k): v for k, v in spec.items() if k != "_target_"}
        target = spec.get("_target_")
        if not isinstance(target, str) or not target:
            raise ConfigError("trainer.strategy as a node needs _target_: the dotted path of a "
                              f"strategy class (got {dict(spec)!r})")
        special = sorted(k for k in rest if k.startswith("_") and k.endswith("_"))
        if special:
            # Hydra's _args_, _partial_, _recursive_, _convert_ mean nothing here: the class
            # is built by the trainer with the node's other keys as keyword arguments.
            raise ConfigError(f"trainer.strategy: {', '.join(special)} is not taken in a "
                              "strategy node; give the class's constructor arguments as keys "
                              f"of the node ({{_target_: {target}, key: value}})")
        return target, rest
    if not isinstance(spec, str):
        raise ConfigError(f"trainer.strategy={spec!r}: name one of [{', '.join(names())}] or "
                          "a strategy class by its dotted path")
    return spec, {}


def _import(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"trainer.strategy={path}: cannot import {module} ({exc}); put the "
                          "package that holds it on PYTHONPATH") from None
    except AttributeError:
        raise ConfigError(f"trainer.strategy={path}: {module} has no {attr}") from None
