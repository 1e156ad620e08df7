"""A sweep's jobs from their overrides to the summary, on any backend
(:mod:`ddpexp.sweep.backend`); the ddp launcher's ``launch()`` and the ``optuna_async`` search
both run on it.

Each job's config is composed here (a bad override fails that job only) and its dir decided.
With ``resume=auto`` and the sweep dir of an earlier sweep, jobs whose dir holds a completed
``metrics.json`` are not run again (their stored metric is returned); the others run, and
ddpexp's ``resume=auto`` continues their last checkpoint. A failing job does not stop the
others (unless ``fail_fast``). A job over ``timeout_s`` is stopped, and so is every job when
SIGTERM/SIGINT stops the sweep: asked first (ddpexp saves a checkpoint), forced
``kill_grace_s`` later. A job dir that a live run holds (:mod:`ddpexp.config.runlock`) is
not run, and a ``launch()`` that meets one is refused as a whole. At the end of every
``launch()`` the sweep's table is written (``summary.csv``/``summary.md``) and printed, and
each job that failed, or that a signal interrupted, is listed with its overrides and cause.

:class:`Driver` is the non-blocking core: ``start()`` hands a job to the backend (or says
there is no room), ``wait_any()`` returns the jobs that ended, each with its JobReturn. The
batch :func:`launch` that Hydra's sweepers call is a loop over it, and so is ddpexp's
asynchronous Optuna search, which starts a new trial the moment a job ends.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf, open_dict

from ddpexp.config import runlock
from ddpexp.config.commands import continue_sweep
from ddpexp.config.rundir import drop_unused_claims, shared_by
from ddpexp.errors import RunDirBusy, RunInterrupted
from ddpexp.record import FINISHED, read_metrics_or_empty
from ddpexp.sweep.backend import (
    Backend,
    Ended,
    HydraSetup,
    Job,
    JobFailed,
    JobSkipped,
    PackedReturn,
    SweepInterrupted,
)
from ddpexp.sweep.job import job_workers
from ddpexp.sweep.settings import Sweep
from ddpexp.sweep.summary import job_error, summarize

log = logging.getLogger("hydra_plugins.ddpexp_launcher")

POLL_S = 0.1


def launch(sweep: Sweep | None, job_overrides: Sequence[Sequence[str]],
           initial_job_idx: int) -> Sequence[JobReturn]:
    """Run the jobs on the sweep's backend as it has room for them; return one JobReturn
    per job, in order (a failed job's ``return_value`` raises its exception). ``sweep``: the
    launcher's, None before its ``setup()`` ran (Hydra's contract calls it first)."""
    if sweep is None:
        raise RuntimeError("a launcher's launch() ran before its setup()")
    backend = sweep.backend()
    sweep_dir = begin(sweep.hydra)
    jobs = [_waiting(prepare(sweep.hydra, list(o), i, sweep_dir))
            for i, o in enumerate(job_overrides, start=initial_job_idx)]
    _refuse_busy(jobs)
    backend.prepare()
    _prepare_loggers(sweep.hydra.config, sweep_dir)
    log.info("%s: %d job(s) in %s, %s", _name(sweep), len(job_overrides), sweep_dir,
             backend.describe())
    pending = [j for j in jobs if j.ret is None]
    failed = any(j.ret is not None and j.outcome == "failed" for j in jobs)
    fail_fast = sweep.settings.fail_fast
    with Driver(sweep, backend) as driver:

        def fill() -> bool:
            """Start waiting jobs while they fit; False once no more may start."""
            if driver.stopped or (fail_fast and failed):
                return False
            while pending and driver.start(pending[0]):
                pending.pop(0)
            return True

        while pending or driver.running:
            if not fill() and not driver.running:
                break
            ended = driver.wait_any()
            for job in ended:
                failed = failed or job.outcome == "failed"
            if ended:
                fill()  # the freed slots first: the table's rewrite can wait
                summarize(sweep.hydra.outcomes, jobs, sweep_dir, final=False)
    reason = (f"not run: the sweep was stopped by {driver.stopped}" if driver.stopped else
              "not run: an earlier job failed and hydra.launcher.fail_fast=true")
    for job in pending:
        job.ret = JobReturn(overrides=job.overrides, cfg=job.config, status=JobStatus.FAILED,
                            _return_value=JobSkipped(reason))
    summarize(sweep.hydra.outcomes, jobs, sweep_dir)
    if driver.stopped:
        raise SweepInterrupted(
            f"the sweep was stopped by {driver.stopped}. To finish it, {continue_sweep(sweep_dir)}",
            driver.stopped)
    return [j.ret for j in jobs]  # pyright: ignore[reportReturnType]  # every job has ended: each has its JobReturn


def _refuse_busy(jobs: list[Job]) -> None:
    """A sweep (resumed) whose job dirs a live run holds is another process's sweep, still
    running: refused as a whole, before any job starts or the summary is rewritten."""
    busy = [j for j in jobs if j.ret is not None and isinstance(j.ret._return_value, RunDirBusy)]
    if busy:
        more = f" ({len(busy)} of this sweep's job dirs are in use)" if len(busy) > 1 else ""
        raise RunDirBusy(str(busy[0].ret._return_value) + more)  # pyright: ignore[reportOptionalMemberAccess]  # busy jobs have their ret


def _name(sweep: Sweep) -> str:
    """The launcher as the sweep's first log line names it (``ddp launcher``)."""
    node = OmegaConf.select(sweep.hydra.config, "hydra.runtime.choices", default=None)
    choice = node.get("hydra/launcher") if node is not None else None
    return f"{choice or sweep.name} launcher"


def begin(hydra: HydraSetup) -> Path:
    """Set up Hydra's globals and logging in the sweep process; create and return the
    sweep dir."""
    setup_globals()
    config = hydra.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    drop_unused_claims(sweep_dir)
    return sweep_dir


def _prepare_loggers(config: Any, sweep_dir: Path) -> None:
    """The loggers' stores, made once here before jobs start side by side (one MLflow
    database for the whole sweep, its schema created by one process)."""
    from ddpexp.loggers import outputs_root, prepare_loggers

    node = OmegaConf.select(config, "logger")
    if node:
        # The logger group is a dict of logger nodes by name.
        prepare_loggers(cast(dict, OmegaConf.to_container(node, resolve=True)),
                        outputs_root(sweep_dir / "0"))


# ------------------------------------------------------------------------------ jobs
def prepare(hydra: HydraSetup, overrides: list[str], idx: int, sweep_dir: Path) -> Job:
    """Compose the job's config (a bad override fails this job only) and decide whether it
    runs at all (``resume=auto`` and already completed: it does not)."""
    job = Job(idx, overrides)
    try:
        cfg = hydra.compose(list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = f"{idx}"
            cfg.hydra.job.num = idx
            # The sweep dir is resolved here, once: resolvers such as ddpexp's unique_dir
            # would pick a fresh dir if the job process resolved it again.
            cfg.hydra.sweep.dir = str(sweep_dir)
        job.config = cfg
        job.subdir = str(cfg.hydra.sweep.subdir)
        job.dir = sweep_dir / job.subdir
        job.gpus = int(OmegaConf.select(cfg, "trainer.gpus", default=0) or 0)
        job.workers = job_workers(cfg)
    except Exception as exc:
        job.ret = JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=exc)
        return job
    refused = runlock.busy(job.dir, shared_by(cfg))
    if refused:  # its own claim would refuse it: no process is started for it
        job.ret = JobReturn(overrides=overrides, cfg=cfg, status=JobStatus.FAILED,
                            _return_value=RunDirBusy(refused))
        return job
    if OmegaConf.select(cfg, "resume", default=None) == "auto":
        _check_resume(job)
    return job


def _check_resume(job: Job) -> None:
    """``resume=auto`` into an existing sweep dir: a job whose dir holds a completed run of
    the same overrides is done; one with other overrides is refused (it is another sweep)."""
    assert job.dir is not None and job.config is not None
    overrides_path = job.dir / ".hydra" / "overrides.yaml"
    if overrides_path.is_file():
        import yaml

        before = _comparable(yaml.safe_load(overrides_path.read_text()) or [])
        now = _comparable(job.overrides)
        if before != now:
            job.ret = JobReturn(overrides=job.overrides, cfg=job.config, status=JobStatus.FAILED,
                                _return_value=JobFailed(
                f"{job.dir} holds a run with overrides {' '.join(before)}, not "
                f"{' '.join(now)}: resume a sweep with the overrides it was started with"))
            return
    metrics = read_metrics_or_empty(job.dir)
    if metrics.get("status") not in FINISHED:
        return
    monitor = metrics.get("monitor")
    value = (metrics.get("best") or {}).get(monitor) if monitor else None
    log.info("\t%s : completed before, not run again (best %s = %s)", job.label, monitor, value)
    job.ret = JobReturn(overrides=job.overrides, cfg=job.config, working_dir=str(job.dir),
                        task_name=str(job.config.hydra.job.name), status=JobStatus.COMPLETED,
                        _return_value=value)


def _comparable(overrides: Sequence[str]) -> list[str]:
    return sorted(o for o in map(str, overrides)
                  if not o.startswith(("resume=", "hydra.", "hydra/", "+hydra", "~hydra")))


# ------------------------------------------------------------------------------ running
class Driver:
    """Jobs running on a backend, without blocking the caller: :meth:`start` hands a job to
    the backend, :meth:`wait_any` waits for running jobs to end. Inside the ``with`` block
    SIGTERM/SIGINT stop the sweep (:attr:`stopped` names the signal): running jobs are
    stopped (they checkpoint), then forced after ``kill_grace_s``; so is a job over
    ``timeout_s``."""

    def __init__(self, sweep: Sweep, backend: Backend) -> None:
        self.hydra = sweep.hydra
        self.backend = backend
        self.running: list[Job] = []
        self.timeout_s = sweep.settings.timeout_s
        self.kill_grace_s = float(sweep.settings.kill_grace_s)
        self._signals = _StopSignals()

    def __enter__(self) -> Driver:
        self.backend.__enter__()
        self._signals.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._signals.__exit__(*exc)
        finally:
            try:
                self.backend.__exit__(*exc)
            finally:
                config = self.hydra.config
                configure_log(config.hydra.hydra_logging, config.hydra.verbose)

    @property
    def stopped(self) -> str | None:
        """The name of the signal that stopped the sweep, or None."""
        return self._signals.signal_name

    @property
    def free(self) -> int:
        """Room for another job now, as the backend says (a job may still not fit)."""
        return self.backend.free

    def start(self, job: Job) -> bool:
        """Start ``job`` on the backend; False (nothing started) when it does not fit now."""
        job.unpack()
        if not self.backend.start(job):
            return False
        self.running.append(job)
        return True

    def wait_any(self) -> list[Job]:
        """Wait until at least one running job has ended; return those that did, each with
        its ``ret``. Time limits and the stop signal are enforced meanwhile. Returns at once
        (empty) when no job is running."""
        while self.running:
            ended = self.backend.wait(POLL_S)
            for end in ended:
                finish(end)
                self.running.remove(end.job)
                _let_go(end.job)
            if ended:
                return [end.job for end in ended]
            for job in self.running:
                self._enforce_limits(job)
        return []

    def _enforce_limits(self, job: Job) -> None:
        """Stop a job over its time limit or when the sweep is stopped; force it when it has
        not ended ``kill_grace_s`` later."""
        now = time.time()
        if job.stopping_since is None:
            over = self.timeout_s is not None and now - job.started > float(self.timeout_s)
            if over or self.stopped:
                if over:
                    log.error("%s ran over hydra.launcher.timeout_s=%s: stopping it", job.label,
                              self.timeout_s)
                    job.timed_out = True
                else:
                    job.stop_signal = "SIGTERM"
                job.stopping_since = now
                self.backend.stop(job)
        elif now - job.stopping_since > self.kill_grace_s:
            if not job.timed_out:
                job.stop_signal = "SIGKILL"
            self.backend.stop(job, force=True)


def finish(end: Ended) -> None:
    """The JobReturn of a job that ended: what it reported, or, when it reported nothing, a
    FAILED return saying how it ended; an exception that is not one of Hydra's compact ones
    is wrapped, pointing at the job's log (its traceback is there)."""
    job, ret = end.job, end.ret
    job.ended = time.time()
    if ret is None:
        why = end.why
        if job.timed_out:
            why += " after running over hydra.launcher.timeout_s"
        elif job.stop_signal is not None:
            why += f" before it reported, while the sweep stopped its jobs ({job.stop_signal} sent)"
        ret = JobReturn(overrides=job.overrides, cfg=job.config, status=JobStatus.FAILED,
                        working_dir=str(job.dir), _return_value=JobFailed(f"job {job.idx}: {why}"))
    elif ret.status == JobStatus.FAILED:
        exc = ret._return_value
        if job.timed_out:
            ret._return_value = JobFailed(f"job {job.idx} ran over hydra.launcher.timeout_s "
                                          f"and was stopped: {job_error(ret)}")
        elif not isinstance(exc, CompactHydraException):
            # Re-raised here, the exception would show a traceback of the launcher, not of
            # the job; the job's traceback is in its log.
            log_file = Path(ret.working_dir or job.dir or ".") / f"{ret.task_name or 'job'}.log"
            if job.dir is not None and job.config is not None:
                log_file = job.dir / f"{job.config.hydra.job.name}.log"
            wrapped = JobFailed(f"job {job.idx} failed with {job_error(ret)}\n"
                                f"(its traceback is in {log_file})")
            wrapped.original = exc  # pyright: ignore[reportAttributeAccessIssue]  # kept for a caller that wants the job's own exception
            ret._return_value = wrapped
    job.ret = PackedReturn.of(ret)
    job.interrupted_by = _interruption(job, end.signal)
    log.info("\t#%d ended (%s) after %.1f s", job.idx, job.outcome + (
        f" by {job.interrupted_by}" if job.interrupted_by else ""), job.ended - job.started)


def _waiting(job: Job) -> Job:
    """A job just composed, as it waits for its turn: its config packed, as each is composed
    (so that a sweep never holds every job's config at once), or let go if it will not run."""
    if job.ret is None:
        job.pack()
    else:
        _let_go(job)
    return job


def _let_go(job: Job) -> None:
    """Drop the config an ended job no longer needs (about 160 KiB in memory); its row needs
    only its outcome. Its result keeps the ``cfg`` and ``hydra_cfg`` it brought back, which
    Hydra's launcher contract gives back to the sweeper."""
    job.config = None


def _interruption(job: Job, ended_by: str | None) -> str | None:
    """The signal that stopped ``job`` when it was interrupted rather than failed: the run
    said so (it saved a checkpoint and names the signal it got), or it ended (by
    ``ended_by``, where known) after the driver stopped it because the sweep was stopped."""
    exc = job.ret._return_value if job.ret is not None else None
    if isinstance(exc, RunInterrupted):
        return exc.signal or job.stop_signal or "a stop signal"
    if job.stop_signal is not None and job.ret is not None and job.ret.status == JobStatus.FAILED:
        return ended_by or job.stop_signal
    return None


class _StopSignals:
    """While the sweep runs, SIGTERM/SIGINT ask it to stop: no new jobs, the running ones
    stopped (ddpexp saves a checkpoint), forced after the grace period."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            log.warning("%s: stopping the sweep's jobs (they save a checkpoint first)",
                        self.signal_name)

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
