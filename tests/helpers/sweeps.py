"""What a sweep wrote: its summary table, and its optuna study (the async search's journal)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import yaml

from helpers.cli import plugins_env, run_cli


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


def sweep_cases(workdir: Path, cases: dict[str, list[str]], common: list[str],
                timeout: float = 420) -> dict[str, Path]:
    """Run one sweep (in ``workdir/sweep``) whose jobs are ``cases``, each a config of
    overrides (``key=value``; a key without a dot other than ``resume`` and ``seed`` is a
    config group's choice); return each case's run dir."""
    group = workdir / "conf" / "case"
    group.mkdir(parents=True)
    for name, overrides in cases.items():
        body: dict = {}
        for item in overrides:
            key, value = item.split("=", 1)
            if "." not in key and key not in ("resume", "seed"):  # a config group's choice
                body.setdefault("defaults", []).append({f"override /{key}": value})
                continue
            node = body
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = yaml.safe_load(value)
        (group / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(body))
    run_cli(["-m", "--config-dir", str(workdir / "conf"), *common, f"+case={','.join(cases)}",
             "hydra.sweep.dir=sweep"], workdir, env=plugins_env(), timeout=timeout)
    return {name: workdir / "sweep" / str(i) for i, name in enumerate(cases)}  # jobs in order
