"""The sweep driver's table (:mod:`ddpexp.sweep.driver`, on any backend): ``summary.csv``
and ``summary.md`` (and ``summary_by_seed.*`` where the sweep varies ``seed``) in the sweep
dir, one row per job, read from what each job left on disk (:mod:`ddpexp.report`) and completed with what the driver knows of jobs that
left nothing (refused, killed, not run); then the jobs that failed, each with its cause.
Under other launchers (Hydra's ``basic``, ``submitit_*``) :class:`SweepSummary`, a Hydra
callback that ddpexp's config names in ``hydra.callbacks``, writes the same files."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ddpexp import report
from ddpexp.errors import DdpexpError
from ddpexp.launch.failures import explain_os_error

log = logging.getLogger("hydra_plugins.ddpexp_launcher")


def summarize(outcomes: dict, jobs: Sequence[Any], sweep_dir: Path, final: bool = True) -> None:
    """Write and print the sweep's table (every job in the sweep dir so far), then list the
    jobs of this launch that failed or were interrupted, with their overrides and cause.
    ``final=False`` (as each job ends): write the table only, so that a launcher that is
    killed leaves the rows of the jobs that ended. ``outcomes``: the sweep's outcomes of every
    ``launch()`` so far, by job subdir (:class:`~ddpexp.sweep.backend.HydraSetup`), updated
    here."""
    for job in jobs:
        if job.ret is None:
            continue
        key = job.subdir if job.subdir is not None else str(job.idx)
        outcome = job.outcome
        outcomes[key] = (job.overrides, outcome,
                         None if outcome == "completed" else job_error(job.ret),
                         round(job.ended - job.started, 3) if job.ended else None)
    rows = {r.job: r for r in report.collect(sweep_dir)}
    for key, (overrides, outcome, cause, wall) in outcomes.items():
        row = rows.get(key) or report.Row(job=key, overrides=report.own_overrides(overrides))
        if outcome != "completed":
            # What the job process knew; metrics.json may say less (a job that failed before
            # training wrote none, a killed one still says running).
            if row.status not in ("failed", "interrupted", "diverged"):
                row.status = outcome
            row.error = row.error or cause
        elif row.status == report.NO_METRICS:  # any Hydra app: the job's own outcome
            row.status = "completed"
        if row.wall_time_s is None:  # the run recorded none (it never got to run)
            row.wall_time_s = wall
        rows[key] = row
    ordered = report.sort_rows(rows.values())
    unwritten = None
    if ordered:
        try:
            report.write_summary(sweep_dir, ordered)
        except OSError as exc:  # a full disk: the jobs' own results are in their dirs
            unwritten = exc
            log.debug("the sweep's table could not be written: %s", exc)
    if not final:
        return
    if ordered:
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.csv",
                 report.format_rows(ordered, "text").rstrip())
    _list_failures(jobs)
    if unwritten is not None:
        cause = explain_os_error(unwritten, sweep_dir=str(sweep_dir))
        raise DdpexpError(
            f"the sweep's table could not be written: {cause}. Each job's results are in its "
            f"own dir under {sweep_dir}; once there is room, python -m ddpexp.report "
            f"{sweep_dir} shows the table")


def _list_failures(jobs: Sequence[Any]) -> None:
    """Log each job of this launch that failed, was interrupted or was not run."""
    ended = [j for j in jobs if j.ret is not None]
    failures = [j for j in ended if j.outcome == "failed"]
    interrupted = [j for j in ended if j.outcome == "interrupted"]
    skipped = [j for j in ended if j.outcome == "not run"]
    if failures:
        log.error("%d of %d job(s) failed:\n%s", len(failures), len(jobs), _listed(failures))
    if interrupted:
        log.warning("%d of %d job(s) interrupted:\n%s", len(interrupted), len(jobs),
                    _listed(interrupted))
    if skipped:
        log.error("%d of %d job(s) not run (%s)", len(skipped), len(jobs),
                  job_error(skipped[0].ret).removeprefix("not run: "))


def _listed(jobs: Sequence[Any]) -> str:
    """Each job's label and, indented below it, its cause."""
    return "\n".join(f"  {j.label}\n      " + job_error(j.ret).strip().replace("\n", "\n      ")
                     for j in jobs)


def job_error(ret: JobReturn) -> str:
    """Why a job did not complete, in one message (its own, for ddpexp's and Hydra's errors)."""
    exc = ret._return_value
    if isinstance(exc, CompactHydraException):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


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
                report.format_rows(rows, "text").rstrip())

    @staticmethod
    def _write(config: DictConfig) -> list[report.Row]:
        if _drives_its_sweep(OmegaConf.select(config, "hydra.launcher._target_", default=None)):
            return []
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = report.collect(sweep_dir) if sweep_dir.is_dir() else []
        if rows:
            report.write_summary(sweep_dir, rows)
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
