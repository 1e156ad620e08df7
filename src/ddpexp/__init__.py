"""ddpexp: Hydra-configured PyTorch experiments where every run and sweep job is a DDP run.

``ddpexp.Task`` (the task contract), ``ddpexp.DataSource`` (a user's own data),
``ddpexp.Callback`` (a user's own callback) and ``ddpexp.Logger`` (a user's own logger) are
what a user's code subclasses; they, and the
submodules, are imported on first use so that ``import ddpexp`` stays cheap.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Task": ("ddpexp.task", "Task"),
    "DataSource": ("ddpexp.data", "DataSource"),
    "Logger": ("ddpexp.loggers", "Logger"),
    "Callback": ("ddpexp.callbacks", "Callback"),
}


def lazy_attributes(package: str, table: dict[str, str]):
    """``__getattr__`` and ``__dir__`` for a package whose public names live in its modules
    (PEP 562): ``table`` maps each name to the module that defines it, imported on first use,
    so that importing the package (or one module of it) imports nothing else."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            setattr(importlib.import_module(package), name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    try:
        return importlib.import_module(f"ddpexp.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'ddpexp' has no attribute {name!r}") from None
