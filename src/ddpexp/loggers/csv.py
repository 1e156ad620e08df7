"""``metrics.csv`` in the run dir: one row per metric point, columns ``step,epoch,name,value``.

Rows are flushed at every ``log_metrics`` call, so a crash keeps what was logged. A resumed
session first drops the rows after its checkpoint's step (they are logged again), rewriting
the file atomically.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

from ddpexp.loggers.base import Logger, RunInfo

FILENAME = "metrics.csv"
HEADER = ("step", "epoch", "name", "value")


class CSVLogger(Logger):
    """Appends every metric point to ``run_dir/metrics.csv``."""

    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self._writer: Any = None

    def open(self, run: RunInfo) -> None:
        """Start the file (a fresh run replaces any old one) or continue it (resumed)."""
        path = Path(run.run_dir) / FILENAME
        resume = run.resumed and path.exists()
        if resume:
            drop_rows_after(path, run.step)
        self._file = open(path, "a" if resume else "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        if not resume:
            self._writer.writerow(HEADER)
            self._file.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """One row per name, flushed before returning."""
        for name, value in metrics.items():
            self._writer.writerow((int(step), int(epoch), name, float(value)))
        cast(IO[str], self._file).flush()  # open() has run

    def finalize(self, status: str) -> None:
        """Close the file (the status is metrics.json's)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_rows(path: Path) -> list[tuple[int, int, str, float]]:
    """The well-formed rows of a metrics.csv as ``(step, epoch, name, value)``; a row cut
    short by a crash, or the header, is left out."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            if len(row) != len(HEADER):
                continue
            try:
                rows.append((int(row[0]), int(row[1]), row[2], float(row[3])))
            except ValueError:
                continue
    return rows


def drop_rows_after(path: Path, step: int) -> None:
    """Rewrite ``path`` without the rows whose step is after ``step`` (nor any partial row),
    atomically: a crash while rewriting leaves the old file whole."""
    kept = [row for row in read_rows(path) if row[0] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
