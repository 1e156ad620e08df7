"""Tables of runs: one row per run dir, read from what the run left on disk.

The sweep launcher writes ``summary.csv`` / ``summary.md`` with this module and prints the
same table; ``python -m ddpexp.report DIR`` (``ddpexp-report DIR``) prints it for any sweep
dir, single run dir or ``outputs/`` tree. The API is small so that other tools (plots,
TensorBoard HParams) can build on the same rows::

    rows = collect(sweep_dir)            # list[Row], best first
    print(format_rows(rows, "text"))     # or "md", "csv", "json"
    groups = group_seeds(rows)           # list[Group]: runs that differ only in seed
    print(format_groups(groups, "text")) # n, mean and std of final, best and test metrics
    write_summary(sweep_dir, rows)       # summary.csv/md (+ summary_by_seed.csv/md)

Everything is read from each run dir's ``metrics.json`` (written by ddpexp's trainer:
status, epochs, steps, ``final``/``best``/``test`` metrics, ``monitor``/``monitor_mode``, wall
time, ``error``), ``.hydra/overrides.yaml`` and the ``seed`` of ``.hydra/config.yaml``. A
run dir without ``metrics.json`` still gets a row (status ``no metrics``), so a job that
failed before training is never silently missing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ddpexp.record import replace_text
from ddpexp.report.rows import (
    COLUMNS,
    FORMATS,
    NO_METRICS,
    Row,
    collect,
    format_rows,
    monitor_of,
    own_overrides,
    read_run,
    run_dirs,
    set_apart,
    sort_rows,
    test_name,
    varying_overrides,
)
from ddpexp.report.seeds import Group, format_groups, group_seeds, varies_seed

# The API other tools build on (docstring above), from the modules that hold it.
__all__ = ["COLUMNS", "FORMATS", "NO_METRICS", "Group", "Row", "SweepSummary", "collect",
           "format_groups", "format_rows", "group_seeds", "main", "own_overrides", "read_run",
           "run_dirs", "set_apart", "sort_rows", "test_name", "varies_seed", "write_summary"]



def write_summary(directory: Path, rows: Sequence[Row]) -> tuple[Path, Path]:
    """Write ``summary.csv`` and ``summary.md`` into ``directory``, and, where some
    configuration ran with several seeds, ``summary_by_seed.csv`` and ``summary_by_seed.md``
    (one row per configuration); returns the paths of the first two."""
    directory = Path(directory)
    csv_path, md_path = directory / "summary.csv", directory / "summary.md"
    replace_text(csv_path, format_rows(rows, "csv"))
    replace_text(md_path, format_rows(rows, "md"))
    if varies_seed(rows):
        groups = group_seeds(rows)
        replace_text(directory / "summary_by_seed.csv", format_groups(groups, "csv"))
        replace_text(directory / "summary_by_seed.md", format_groups(groups, "md"))
    return csv_path, md_path


class SweepSummary(Callback):
    """The sweep table under launchers that know nothing of it (Hydra's ``submitit_slurm``,
    ``submitit_local``, ``basic``); ddpexp's config names it in ``hydra.callbacks``. It is
    refreshed as each job ends, in the job's process (so that a sweep whose last job failed,
    which Hydra then ends with that job's error, still has its table), and written once more,
    and printed, when the sweep ends. A launcher that runs its jobs through ddpexp's sweep
    driver (one that offers a backend: ``ddp``) writes its own."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN:
            self._write(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        rows = self._write(config)
        if rows:
            logging.getLogger("ddpexp").info(
                "sweep summary (%s):\n%s", Path(config.hydra.sweep.dir) / "summary.csv",
                format_rows(rows, "text").rstrip())

    @staticmethod
    def _write(config: DictConfig) -> list[Row]:
        if _drives_its_sweep(OmegaConf.select(config, "hydra.launcher._target_", default=None)):
            return []
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = collect(sweep_dir) if sweep_dir.is_dir() else []
        if rows:
            write_summary(sweep_dir, rows)
        return rows


def _drives_its_sweep(target: Any) -> bool:
    """Whether the launcher class ``target`` names runs its jobs through ddpexp's sweep driver,
    which writes the table itself: it declares the ``sweep`` it hands the driver
    (:class:`ddpexp.sweep.settings.SweepLauncher`). Hydra's plugin modules are light to import
    (Hydra imports every one at start)."""
    if not target:
        return False
    from hydra.utils import get_class

    try:
        return hasattr(get_class(str(target)), "sweep")
    except Exception:  # a launcher that cannot be imported here drives nothing of ddpexp's
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpexp.report DIR [--format F]``: print the table of the runs under DIR."""
    parser = argparse.ArgumentParser(prog="ddpexp-report", description=main.__doc__)
    parser.add_argument("dir", type=Path, help="a sweep dir, a run dir or outputs/")
    parser.add_argument("--format", "-f", choices=FORMATS, default="text")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="also draw the runs' validation curves (the monitored metric and val/loss), one line per run")
    parser.add_argument("--group-seeds", action="store_true",
                        help="one row per configuration: runs that differ only in seed, with n and "
                             "the mean and standard deviation of the final, best and test metrics "
                             "(with --plot: the mean curve and a band of one standard deviation)")
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"{args.dir} is not a directory")
    rows = collect(args.dir)
    if not rows:
        print(f"no runs under {args.dir}", file=sys.stderr)
        return 1
    groups = group_seeds(rows) if args.group_seeds else None
    sys.stdout.write(format_groups(groups, args.format) if groups is not None
                     else format_rows(rows, args.format))
    for row in rows:
        if row.status == "unreadable":
            print(f"note: run {row.job} skipped: {row.error}", file=sys.stderr)
    if args.plot is not None:
        try:
            _plot(rows, groups, args.plot)
        except OSError as exc:
            print(f"--plot {args.plot}: cannot write it ({exc.strerror or exc}); pick a path in "
                  "a directory you can write to", file=sys.stderr)
            return 1
    return 0


def _plot(rows: Sequence[Row], groups: Sequence[Group] | None, out: Path) -> None:
    from ddpexp.plot import plot_curves, plot_groups

    monitor = monitor_of(rows) or "val/loss"
    tags = [monitor] + (["val/loss"] if monitor != "val/loss" else [])
    if groups is not None:
        varying = varying_overrides(groups)
        labelled = [(" ".join(o for o in g.overrides if varying is None or o in varying)
                     or "all runs", [Path(d) for d in g.dirs]) for g in groups]
        drawn = plot_groups(labelled, out, tags)
        print(f"wrote {out}: {drawn} configurations, the mean over seeds with a band of one "
              "standard deviation", file=sys.stderr)
        return
    varying = varying_overrides(rows)
    runs = [(_label(r, varying), Path(r.dir)) for r in rows if r.dir]
    drawn = plot_curves(runs, out, tags)
    print(f"wrote {out}: {drawn} runs, one curve each", file=sys.stderr)


def _label(row: Row, varying: set | None) -> str:
    shown = [o for o in row.overrides if varying is None or o in varying]
    return f"{row.job}: {' '.join(shown)}" if shown else row.job
