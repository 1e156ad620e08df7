"""The sweep driver's table (:mod:`ddpexp.sweep.driver`, on any backend): ``summary.csv``
and ``summary.md`` (and ``summary_by_seed.*`` where the sweep varies ``seed``) in the sweep
dir, one row per job, read from what each job left on disk (:mod:`ddpexp.report`) and completed with what the driver knows of jobs that
left nothing (refused, killed, not run); then the jobs that failed, each with its cause.
Under other launchers (Hydra's ``basic``, ``submitit_*``) :class:`ddpexp.report.SweepSummary`,
a Hydra callback that ddpexp's config names in ``hydra.callbacks``, writes the same files."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException

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
