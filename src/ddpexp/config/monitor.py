"""Which metric a run is judged by: ``trainer.monitor`` and ``trainer.monitor_mode``, the
task's own defaults where they are null.

The run's parent resolves them once, so that every reader (workers, ``metrics.json``, the
sweep summary, sweepers) sees the same names; a sweeper resolves them the same way to pick its
direction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpexp.errors import ConfigError

# What a task class that names no monitor is judged by (ddpexp.task.Task's own defaults).
DEFAULT_MONITOR, DEFAULT_MONITOR_MODE = "val/loss", "min"

# Name parts of metrics where larger is better; any other metric a user monitors is minimised.
_LARGER_IS_BETTER = ("acc", "f1", "auc", "auroc", "precision", "recall", "score", "iou", "dice",
                     "r2", "bleu")


def resolve_monitor(task_target: str, monitor: str | None = None,
                    mode: str | None = None) -> tuple[str, str]:
    """``(monitor, mode)`` of a run of the task class ``task_target``: ``monitor`` and
    ``mode`` (``"max"``/``"min"``) where given, else the task's class attributes; the mode
    of a monitor of the user's own choice is guessed from its name (:func:`guess_mode`)."""
    if monitor is not None and mode is not None:
        return str(monitor), str(mode)
    task_monitor, task_mode = task_defaults(task_target)
    if monitor is None:
        return task_monitor, str(mode) if mode is not None else task_mode
    return str(monitor), task_mode if monitor == task_monitor else guess_mode(str(monitor))


def task_defaults(target: str) -> tuple[str, str]:
    """``(monitor, monitor_mode)`` of the task class ``target`` names, read from its class
    attributes without building it."""
    from hydra.utils import get_class

    try:
        # Importing the task class imports torch: only when the task's defaults are needed.
        cls = get_class(target)
    except Exception as exc:  # ImportError, AttributeError, hydra's own wrapping
        raise ConfigError(f"task._target_={target} cannot be imported: {exc}") from None
    monitor = getattr(cls, "monitor", DEFAULT_MONITOR)
    mode = str(getattr(cls, "monitor_mode", DEFAULT_MONITOR_MODE))
    if mode not in ("min", "max"):
        raise ConfigError(f"{target}.monitor_mode={mode!r} is not one of min, max")
    return monitor, mode


def with_monitor(config: Mapping[str, Any]) -> dict:
    """A resolved config (plain Python, as workers receive it) with ``trainer.monitor`` and
    ``monitor_mode`` filled in where they are null, as :func:`resolve_monitor` says; the
    config given is left as it is."""
    t = config["trainer"]
    monitor, mode = resolve_monitor(config["task"]["_target_"], t.get("monitor"),
                                    t.get("monitor_mode"))
    return {**config, "trainer": {**t, "monitor": monitor, "monitor_mode": mode}}


def guess_mode(monitor: str) -> str:
    """``"max"`` for names of metrics where larger is better (``val/acc``, ``val/f1``...),
    else ``"min"`` (``val/loss``, ``val/mse``...)."""
    name = monitor.rsplit("/", 1)[-1].lower()
    return "max" if any(k in name for k in _LARGER_IS_BETTER) else "min"
