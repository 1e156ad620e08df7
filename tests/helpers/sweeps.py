"""What a sweep wrote: its summary table, and its optuna study (the async search's journal)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def summary_by_job(sweep_dir: Path) -> dict[str, dict]:
    """The rows of ``sweep_dir/summary.csv``, keyed by their ``job`` column."""
    with open(sweep_dir / "summary.csv", newline="") as f:
        return {r["job"]: r for r in csv.DictReader(f)}


def journal_study(sweep_dir: Path, direction: str = "maximize") -> Any:
    """The optuna study of an ``optuna_async`` search in ``sweep_dir``, as the sweeper opens
    it (created where there is none yet, so that trials can be enqueued before the sweep)."""
    import optuna

    from ddpexp.runtime import trial as pruning
    from ddpexp.sweep import search

    sweep_dir.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(study_name="ddpexp", direction=direction, load_if_exists=True,
                               storage=pruning.journal_storage(str(sweep_dir / search.JOURNAL)))
