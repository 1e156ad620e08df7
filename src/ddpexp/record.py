"""The run record: ``metrics.json`` in a run dir, which says how the run went.

The trainer writes it as the run goes (status, epochs, steps, final, best and test metrics,
``train_time_s``: the training loop's time); the run's parent adds the whole run's
``wall_time_s`` at the end (start-up included: from when the launcher started the sweep
job's process, :data:`JOB_STARTED_ENV`) and marks an attempt that failed or was interrupted.
The sweep launcher, its sweepers and ``ddpexp.report`` read it. Every write replaces the file
atomically, so a reader never sees half of one; NaN and infinite values are written as
``null`` (JSON has no such numbers, and a bare ``NaN`` breaks strict readers).

This module imports neither torch nor the trainer: the sweep process and the report read
records without loading either.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from ddpexp.errors import RunInterrupted, naming

METRICS_FILE = "metrics.json"
# The statuses of a run that ended as intended (its best.pt tested, a sweep's resume skips it);
# the others (interrupted, failed, diverged, pruned) ended it early or badly.
FINISHED = ("completed", "early_stopped", "stopped")
# Where a launcher that starts each sweep job in a process of its own (ddpexp's) puts the time
# (time.time()) it started it, so that the run's wall time counts the job's start-up too.
JOB_STARTED_ENV = "DDPEXP_JOB_STARTED"


class UnreadableRecord(ValueError):
    """A ``metrics.json`` that exists but holds no run record (not JSON, not an object, or a
    file that cannot be read); the message names the file."""


def write_metrics(run_dir: Path, record: dict) -> None:
    """Atomically replace ``run_dir/metrics.json`` with ``record``."""
    text = json.dumps(_finite(record), indent=2, default=float, allow_nan=False)
    replace_text(Path(run_dir) / METRICS_FILE, text + "\n")


def replace_text(path: Path, text: str, errors: str = "strict") -> None:
    """Write ``path`` whole or not at all: the text goes to a temporary file beside it, which
    then replaces it, so a process killed mid-write (or a full disk) leaves the previous file
    and no partial one. A failed write is raised naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, errors=errors)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise naming(exc, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_metrics(run_dir: Path) -> dict:
    """What ``run_dir/metrics.json`` holds. ``FileNotFoundError`` where there is none,
    :class:`UnreadableRecord` where it holds no record."""
    path = Path(run_dir) / METRICS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise UnreadableRecord(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise UnreadableRecord(f"{path} holds a JSON {type(data).__name__}, not a run's metrics object")
    return data


def read_metrics_or_empty(run_dir: Path) -> dict:
    """What ``run_dir/metrics.json`` holds, or ``{}`` where there is no readable record (a run
    that never got to train, a file cut off by a crash)."""
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, UnreadableRecord):
        return {}


def run_started() -> float:
    """When this run started, for its wall time: when the launcher started the sweep job's
    process (:data:`JOB_STARTED_ENV`), else now."""
    try:
        return float(os.environ[JOB_STARTED_ENV])
    except (KeyError, ValueError):
        return time.time()


def record_wall_time(run_dir: Path, result: dict, started: float) -> None:
    """Add the run's ``wall_time_s`` (since ``started``, from :func:`run_started`) to
    ``result``, the record its trainer returned, and write it."""
    result["wall_time_s"] = _since(started)
    write_metrics(run_dir, result)


def record_failure(run_dir: Path, exc: BaseException, started: float) -> None:
    """Mark this attempt ``failed`` (``interrupted`` for :class:`RunInterrupted`) with its
    error and wall time, so that sweeps and reports see it. A run that failed before training
    (a bad resume, say) leaves an earlier attempt's finished record alone. A disk that cannot
    take the record (full, read-only) is let be: the error still reaches the terminal."""
    data = read_metrics_or_empty(run_dir)
    if data.get("status", "running") != "running":
        return
    data.update(status="interrupted" if isinstance(exc, RunInterrupted) else "failed",
                error=str(exc), wall_time_s=_since(started))
    try:
        write_metrics(run_dir, data)
    except OSError:
        pass


def _since(started: float) -> float:
    return round(time.time() - started, 3)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by None; one-element
    tensors (anything with ``numel()`` and ``item()``, so torch need not be imported) become
    numbers."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if callable(getattr(value, "numel", None)) and callable(getattr(value, "item", None)) \
            and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
