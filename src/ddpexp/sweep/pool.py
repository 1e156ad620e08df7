"""The ddp launcher's work, which its Hydra plugin (``hydra_plugins.ddpexp_launcher``) hands
over to inside ``launch()``.

Every sweep job runs in its own process (:mod:`ddpexp.sweep.job`), in its own process group, so that a job
and every worker it fans out can be stopped together. Up to ``max_parallel`` jobs run at
once, each on its own slice of the machine: a disjoint set of CPU cores (its affinity, which
its workers inherit, and matching OpenMP/MKL thread counts) and, for a job with
``trainer.gpus=N``, N GPUs of its own through ``CUDA_VISIBLE_DEVICES``. A job that needs
more than is free waits. A failing job does not stop the others (unless ``fail_fast``); at
the end of every ``launch()`` the sweep's table is written (``summary.csv``/``summary.md``)
and printed, and each job that failed, or that a signal interrupted, is listed with its
overrides and cause.

With ``resume=auto`` and the sweep dir of an earlier sweep, jobs whose dir holds a completed
``metrics.json`` are not run again (their stored metric is returned); the others run, and
ddpexp's ``resume=auto`` continues their last checkpoint.

:class:`Pool` is the non-blocking core: ``start()`` puts a job on a free slice (or says there
is none), ``wait_any()`` returns the jobs that ended. The batch :func:`launch` that Hydra's
sweepers call is a loop over it, and so is ddpexp's asynchronous Optuna sweeper, which
starts a new trial the moment a slot frees.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from ddpexp.config.cli import SWEEP_COMMAND_ENV, continue_sweep, sweep_command
from ddpexp.config.rundir import drop_unused_claims
from ddpexp.errors import RunInterrupted
from ddpexp.record import FINISHED, JOB_STARTED_ENV, read_metrics_or_empty
from ddpexp.sweep.forkserver import ForkedJob, ForkServer, adopt_early, discard_early
from ddpexp.sweep.job import job_workers
from ddpexp.sweep.summary import job_error, summarize

log = logging.getLogger("hydra_plugins.ddpexp_launcher")

POLL_S = 0.1


class JobFailed(CompactHydraException):
    """A job ended without a result (killed, timed out, crashed before reporting)."""


class JobSkipped(CompactHydraException):
    """A job not started because an earlier one failed and ``fail_fast`` is set."""


class SweepInterrupted(CompactHydraException):
    """SIGTERM/SIGINT stopped the sweep; the message says how to resume it."""


# ------------------------------------------------------------------------------ slices
class Slices:
    """The machine cut into ``parallel`` disjoint CPU core sets, plus a pool of GPU ids
    (an explicit ``max_parallel``).

    A job takes one core set and ``gpus`` GPU ids and gives them back when it ends.
    """

    def __init__(self, parallel: int, gpu_ids: Sequence[str]) -> None:
        cores = _cores()
        n = max(1, min(parallel, len(cores) or parallel))
        if cores and parallel > len(cores):
            log.warning("max_parallel=%d but this process may use %d cores: running %d jobs "
                        "at once, one core each", parallel, len(cores), n)
        self.split = n > 1
        if cores:
            size, extra = divmod(len(cores), n)
            chunks, start = [], 0
            for i in range(n):
                end = start + size + (1 if i < extra else 0)
                chunks.append(cores[start:end])
                start = end
        else:
            chunks = [[] for _ in range(n)]
        self.free_cores: list[list[int]] = chunks
        self.all_gpus = list(gpu_ids)
        self.free_gpus = list(gpu_ids)

    @property
    def free(self) -> int:
        """Core sets not in use."""
        return len(self.free_cores)

    def take(self, gpus: int, workers: int = 1) -> tuple | None:
        """A (cores, gpu ids) slice for a job that needs ``gpus`` GPUs, or None to wait.
        A job asking for more GPUs than the pool holds gets the whole pool when it is idle,
        so that it fails with its own clear message instead of waiting forever."""
        if not self.free_cores:
            return None
        fit = _fit(gpus, self.free_gpus, self.all_gpus)
        if fit is None:
            return None
        cores = self.free_cores.pop(0)
        ids, self.free_gpus = self.free_gpus[:fit], self.free_gpus[fit:]
        return cores, ids

    def add_gpus(self, gpu_ids: Sequence[str]) -> None:
        """Set the GPU pool once it is known (before, no job holds a GPU)."""
        self.all_gpus = list(gpu_ids)
        self.free_gpus = list(gpu_ids)

    def give_back(self, cores: list[int], ids: list[str]) -> None:
        self.free_cores.append(cores)
        self.free_cores.sort()
        self.free_gpus = [g for g in self.all_gpus if g in set(self.free_gpus) | set(ids)]

    def describe(self) -> str:
        return f"up to {len(self.free_cores)} at once"


class Packing:
    """The machine as free cores and GPUs (``max_parallel: null``): a job takes ``gpus``
    free GPUs and a core per worker (on a GPU box, at least its GPUs' share of the cores),
    and starts as soon as they are free, so that jobs of different sizes pack the machine.
    No job starts while the memory available is below the largest peak a finished job of the
    sweep reached (:meth:`saw_peak`).

    A job that needs more than the machine has gets all of it once the machine is idle (it
    then fails, or oversubscribes, with its own message instead of waiting forever)."""

    split = True

    def __init__(self, gpu_ids: Sequence[str]) -> None:
        self.all_cores = _cores()
        self.free_cores = list(self.all_cores)
        self.all_gpus = list(gpu_ids)
        self.free_gpus = list(gpu_ids)
        self.peak_bytes = 0
        self._memory_said = False

    @property
    def free(self) -> int:
        """Free cores: the workers a job started now could have."""
        return len(self.free_cores) if self.all_cores else 1

    def cores_for(self, gpus: int, workers: int) -> int:
        need = max(1, workers)
        if gpus > 0 and self.all_gpus and self.all_cores:
            need = max(need, len(self.all_cores) * min(gpus, len(self.all_gpus))
                       // len(self.all_gpus))
        return min(need, len(self.all_cores)) if self.all_cores else 0

    def take(self, gpus: int, workers: int = 1) -> tuple | None:
        idle = len(self.free_cores) == len(self.all_cores) and len(self.free_gpus) == len(self.all_gpus)
        if not idle and self.peak_bytes and available_memory() < self.peak_bytes:
            if not self._memory_said:
                self._memory_said = True
                log.info("waiting for memory: %.1f GiB available, a finished job peaked at "
                         "%.1f GiB", available_memory() / 2**30, self.peak_bytes / 2**30)
            return None
        n = self.cores_for(gpus, workers)
        if n > len(self.free_cores):
            return None
        fit = _fit(gpus, self.free_gpus, self.all_gpus)
        if fit is None:
            return None
        cores, self.free_cores = self.free_cores[:n], self.free_cores[n:]
        ids, self.free_gpus = self.free_gpus[:fit], self.free_gpus[fit:]
        self._memory_said = False
        return cores, ids

    def add_gpus(self, gpu_ids: Sequence[str]) -> None:
        self.all_gpus = list(gpu_ids)
        self.free_gpus = list(gpu_ids)

    def give_back(self, cores: list[int], ids: list[str]) -> None:
        self.free_cores = sorted(set(self.free_cores) | set(cores))
        self.free_gpus = [g for g in self.all_gpus if g in set(self.free_gpus) | set(ids)]

    def saw_peak(self, peak_bytes: int) -> None:
        """A finished job's peak memory: later jobs start only while this much is available."""
        self.peak_bytes = max(self.peak_bytes, int(peak_bytes))

    def describe(self) -> str:
        where = f"{len(self.all_cores)} cores" if self.all_cores else "the CPU"
        if self.all_gpus:
            where += f" and {len(self.all_gpus)} GPUs"
        return (f"as many at once as {where} hold (trainer.gpus GPUs and a core per worker "
                "each; hydra.launcher.max_parallel=K for K equal slices)")


def _fit(gpus: int, free: list[str], every: list[str]) -> int | None:
    """The GPUs a job asking for ``gpus`` gets now, or None to wait: the whole pool (once
    idle) for one asking for more than the pool holds."""
    if gpus > len(every):
        return len(every) if len(free) == len(every) else None
    return gpus if gpus <= len(free) else None


def _cores() -> list[int]:
    """The cores this process may use; where the system has no affinity mask (macOS), as many
    as it has (counted, not pinned: the job sets an affinity only where it can)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_memory() -> int:
    """Bytes of memory available to new processes (``MemAvailable``); a large number where
    the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def make_slices(launcher: Any) -> Slices | Packing:
    """The launcher's way of sharing the machine: K equal slices for ``max_parallel=K``,
    packing for ``max_parallel: null``."""
    parallel = getattr(launcher, "max_parallel", None)
    return Packing([]) if parallel is None else Slices(max(1, int(parallel)), [])


def _gpu_pool(limit: int | None) -> list[str]:
    """The GPU ids this sweep may hand out (entries of CUDA_VISIBLE_DEVICES if set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ids if limit is None else ids[: max(0, int(limit))]


# ------------------------------------------------------------------------------ jobs
@dataclass
class Job:
    """One sweep job, from its overrides to its JobReturn."""

    idx: int
    overrides: list[str]
    config: DictConfig | None = None
    dir: Path | None = None
    gpus: int = 0
    # Its run's worker processes on this machine: a core each when the launcher packs.
    workers: int = 1
    ret: JobReturn | None = None
    proc: subprocess.Popen | ForkedJob | None = None
    slice: tuple | None = None
    started: float = 0.0
    stopping_since: float | None = None
    timed_out: bool = False
    files: list[str] = field(default_factory=list)
    # Extra environment of the job process (its workers inherit it).
    env: dict[str, str] = field(default_factory=dict)
    ended: float = 0.0
    # The last signal the launcher sent to stop the job because the sweep was stopped.
    stop_signal: str | None = None
    # The signal that interrupted the job (it ended without failing), once it has ended.
    interrupted_by: str | None = None
    # The most memory the job's processes held, as the job measured it (0: not known).
    peak_bytes: int = 0

    @property
    def label(self) -> str:
        return f"#{self.idx} : {' '.join(filter_overrides(self.overrides))}"

    @property
    def outcome(self) -> str:
        """How the job ended, as its summary row says: completed, failed, interrupted or
        not run."""
        assert self.ret is not None, "the job has not ended"
        if self.ret.status == JobStatus.COMPLETED:
            return "completed"
        if self.interrupted_by is not None:
            return "interrupted"
        return "not run" if isinstance(self.ret._return_value, JobSkipped) else "failed"


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    """Run the jobs as processes, at most ``max_parallel`` at once; return one JobReturn per
    job, in order (a failed job's ``return_value`` raises its exception)."""
    sweep_dir = begin(launcher)
    pool = Pool(launcher)
    pool.start_server()
    _prepare_loggers(launcher.config, sweep_dir)
    log.info("ddp launcher: %d job(s) in %s, %s", len(job_overrides), sweep_dir,
             pool.slices.describe())
    jobs = [prepare(launcher, list(o), i, sweep_dir)
            for i, o in enumerate(job_overrides, start=initial_job_idx)]
    pending = [j for j in jobs if j.ret is None]
    failed = any(j.ret is not None and j.outcome == "failed" for j in jobs)
    with pool:
        while pending or pool.running:
            if not pool.stopped and not (launcher.fail_fast and failed):
                while pending and pool.start(pending[0]):
                    pending.pop(0)
            elif not pool.running:
                break
            ended = pool.wait_any()
            for job in ended:
                failed = failed or job.outcome == "failed"
            if ended:
                summarize(launcher, jobs, sweep_dir, final=False)
    reason = (f"not run: the sweep was stopped by {pool.stopped}" if pool.stopped else
              "not run: an earlier job failed and hydra.launcher.fail_fast=true")
    for job in pending:
        job.ret = JobReturn(overrides=job.overrides, cfg=job.config, status=JobStatus.FAILED,
                            _return_value=JobSkipped(reason))
    summarize(launcher, jobs, sweep_dir)
    if pool.stopped:
        raise SweepInterrupted(
            f"the sweep was stopped by {pool.stopped}. To finish it, {continue_sweep(sweep_dir)}"
        )
    return [j.ret for j in jobs]  # pyright: ignore[reportReturnType]  # every job has ended: each has its JobReturn


def begin(launcher: Any) -> Path:
    """Set up Hydra's globals and logging in the sweep process; create and return the
    sweep dir."""
    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    drop_unused_claims(sweep_dir)
    return sweep_dir


def _prepare_loggers(config: Any, sweep_dir: Path) -> None:
    """The loggers' stores, made once here before jobs start side by side (one MLflow
    database for the whole sweep, its schema created by one process)."""
    from omegaconf import OmegaConf

    from ddpexp.loggers import outputs_root, prepare_loggers

    node = OmegaConf.select(config, "logger")
    if node:
        # The logger group is a dict of logger nodes by name.
        prepare_loggers(cast(dict, OmegaConf.to_container(node, resolve=True)),
                        outputs_root(sweep_dir / "0"))


class Pool:
    """Jobs running on the machine's slices, without blocking the caller: :meth:`start`
    puts a job on a free slice, :meth:`wait_any` waits for running jobs to end. Inside the
    ``with`` block SIGTERM/SIGINT stop the sweep (:attr:`stopped` names the signal): running
    jobs get SIGTERM (they checkpoint), then SIGKILL after ``kill_grace_s``."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher
        self.slices = make_slices(launcher)
        self.running: list[Job] = []
        self._gpus_known = False
        self._signals = _StopSignals()
        self._workdir: Path | None = None
        self._server: ForkServer | None = None

    def start_server(self) -> None:
        """Start the fork server, so that its imports run while the caller prepares the jobs
        (``__enter__`` starts it where the caller did not)."""
        if self._server is None and not getattr(self.launcher, "fork", True):
            discard_early()  # hydra.launcher.fork=false set in a config file
        elif self._server is None:
            # ddpexp's own app (its config has a trainer): torch and the run, preloaded.
            ddpexp_app = OmegaConf.select(self.launcher.config, "trainer") is not None
            preload = getattr(self.launcher, "preload", None) or ()
            # The command's own, started as it began (ddpexp.__main__), where it fits.
            self._server = adopt_early(preload, torch=ddpexp_app)
            if self._server is None:
                self._server = ForkServer(preload, torch=ddpexp_app)
                self._server.start()

    def __enter__(self) -> Pool:
        self._workdir = Path(tempfile.mkdtemp(prefix="ddp-launcher-"))
        self.start_server()
        if self._server is not None:
            self._server.wait_ready()
        self._signals.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            # An exception in the caller: nothing of its jobs may outlive the sweep.
            for job in self.running:
                _signal_group(job, signal.SIGKILL)
            self._signals.__exit__(*exc)
        finally:
            if self._server is not None:
                self._server.close()
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
            config = self.launcher.config
            configure_log(config.hydra.hydra_logging, config.hydra.verbose)

    @property
    def stopped(self) -> str | None:
        """The name of the signal that stopped the sweep, or None."""
        return self._signals.signal_name

    @property
    def free(self) -> int:
        """Room for another job now: free core slices, or free cores when packing (a job
        also needs its GPUs, and its cores when packing, free to start)."""
        return self.slices.free

    def start(self, job: Job) -> bool:
        """Start ``job`` on a free slice; False (nothing started) when none fits it now."""
        if job.gpus > 0 and not self._gpus_known:
            # Only a sweep that asks for GPUs looks for them (and imports torch to count them).
            self.slices.add_gpus(_gpu_pool(self.launcher.gpus))
            self._gpus_known = True
        taken = self.slices.take(job.gpus, job.workers)
        if taken is None:
            return False
        assert self._workdir is not None, "Pool.start() outside its with block"
        _start(self.launcher, job, taken, self.slices.split, self._workdir, self._server)
        self.running.append(job)
        return True

    def wait_any(self) -> list[Job]:
        """Wait until at least one running job has ended; return those that did, each with
        its ``ret`` and its slice given back. Time limits and the stop signal are enforced
        meanwhile. Returns at once (empty) when no job is running."""
        while self.running:
            ended = []
            for job in list(self.running):
                if job.proc.poll() is not None:  # pyright: ignore[reportOptionalMemberAccess]  # a running job has its process
                    _finish(job)
                    if job.peak_bytes and isinstance(self.slices, Packing):
                        self.slices.saw_peak(job.peak_bytes)
                    self.slices.give_back(*job.slice)  # pyright: ignore[reportOptionalIterable]  # a started job holds its slice
                    self.running.remove(job)
                    ended.append(job)
                else:
                    _enforce_limits(self.launcher, job, self._signals)
            if ended:
                return ended
            time.sleep(POLL_S)
        return []


def prepare(launcher: Any, overrides: list[str], idx: int, sweep_dir: Path) -> Job:
    """Compose the job's config (a bad override fails this job only) and decide whether it
    runs at all (``resume=auto`` and already completed: it does not)."""
    job = Job(idx, overrides)
    try:
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.id = f"{idx}"
            cfg.hydra.job.num = idx
            # The sweep dir is resolved here, once: resolvers such as ddpexp's unique_dir
            # would pick a fresh dir if the job process resolved it again.
            cfg.hydra.sweep.dir = str(sweep_dir)
        job.config = cfg
        job.dir = sweep_dir / str(cfg.hydra.sweep.subdir)
        job.gpus = int(OmegaConf.select(cfg, "trainer.gpus", default=0) or 0)
        job.workers = job_workers(cfg)
    except Exception as exc:
        job.ret = JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=exc)
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
def _start(launcher: Any, job: Job, taken: tuple, split: bool, workdir: Path,
           server: ForkServer | None = None) -> None:
    """Write the job's spec and start its process: forked by ``server`` where it can,
    else a fresh ``python -m ddpexp.sweep.job``."""
    import cloudpickle

    cores, gpu_ids = taken
    job.slice = taken
    spec_path, result_path = workdir / f"job-{job.idx}.spec", workdir / f"job-{job.idx}.result"
    with open(spec_path, "wb") as f:
        pickle.dump({"sys_path": list(sys.path), "cores": cores if split else []}, f)
        cloudpickle.dump({
            "task_function": launcher.task_function,
            "config": job.config,
            "hydra_context": launcher.hydra_context,
            "singleton_state": Singleton.get_state(),
        }, f)
    job.started = time.time()
    # The run counts its wall time from here, the job process's start-up included.
    env = {**os.environ, **job.env, JOB_STARTED_ENV: repr(job.started)}
    command = sweep_command()
    if command is not None:  # what a job's "continue it with" repeats
        env[SWEEP_COMMAND_ENV] = json.dumps(command)
    if split and cores:
        # Workers split these further (ddpexp.launch.worker.set_threads divides the affinity mask).
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(len(cores))
    if job.gpus > 0:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    log.info("\t%s%s", job.label, _where(cores if split else [], gpu_ids))
    job.files = [str(spec_path), str(result_path), f"{result_path}.peak"]
    # Its own process group (same session): one killpg stops the job and all its workers.
    group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                             else {"preexec_fn": os.setpgrp})
    forked = server.spawn(spec_path, result_path, env) if server is not None else None
    job.proc = forked or subprocess.Popen(
        [sys.executable, "-m", "ddpexp.sweep.job", str(spec_path), str(result_path)],
        env=env, **group,
    )


def _where(cores: list[int], gpu_ids: list[str]) -> str:
    parts = []
    if cores:
        parts.append("cores " + ",".join(map(str, cores)))
    if gpu_ids:
        parts.append("GPUs " + ",".join(gpu_ids))
    return f"  [{'; '.join(parts)}]" if parts else ""


def _enforce_limits(launcher: Any, job: Job, stop: _StopSignals) -> None:
    """SIGTERM a job over its time limit or when the sweep is stopped; SIGKILL its group
    when it has not exited ``kill_grace_s`` later."""
    now = time.time()
    if job.stopping_since is None:
        over = launcher.timeout_s is not None and now - job.started > float(launcher.timeout_s)
        if over or stop.signal_name:
            if over:
                log.error("%s ran over hydra.launcher.timeout_s=%s: stopping it", job.label,
                          launcher.timeout_s)
                job.timed_out = True
            else:
                job.stop_signal = "SIGTERM"
            job.stopping_since = now
            _signal_group(job, signal.SIGTERM)
    elif now - job.stopping_since > float(launcher.kill_grace_s):
        if not job.timed_out:
            job.stop_signal = "SIGKILL"
        _signal_group(job, signal.SIGKILL)


def _signal_group(job: Job, sig: int) -> None:
    try:
        os.killpg(job.proc.pid, sig)  # pyright: ignore[reportOptionalMemberAccess]  # only started jobs are signalled
    except (ProcessLookupError, PermissionError):
        pass


def _finish(job: Job) -> None:
    """Read the job's JobReturn; a job that died without one gets a FAILED return saying how."""
    code = cast(int, job.proc.returncode)  # pyright: ignore[reportOptionalMemberAccess]  # only started jobs finish, after poll() gave their code
    job.ended = time.time()
    # Workers of a job that died abruptly may outlive it: nothing of a job survives it.
    _signal_group(job, signal.SIGKILL)
    result_path = Path(job.files[1])
    job.peak_bytes = _peak(result_path)
    ret: JobReturn | None = None
    if result_path.is_file():
        import cloudpickle

        try:
            ret = cloudpickle.loads(result_path.read_bytes())
        except Exception as exc:
            ret = None
            why = f"its result could not be read ({type(exc).__name__}: {exc})"
    if ret is None:
        if code < 0:
            try:
                why = f"its process was killed by {signal.Signals(-code).name}"
            except ValueError:
                why = f"its process was killed by signal {-code}"
        else:
            why = f"its process exited with code {code} without a result"
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
    job.ret = ret
    job.interrupted_by = _interruption(job, code)
    log.info("\t#%d ended (%s) after %.1f s", job.idx, job.outcome + (
        f" by {job.interrupted_by}" if job.interrupted_by else ""), job.ended - job.started)


def _peak(result_path: Path) -> int:
    """The peak memory a job wrote beside its result (:func:`ddpexp.sweep.job.peak_bytes`)."""
    try:
        return int(json.loads(Path(f"{result_path}.peak").read_text())["peak_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _interruption(job: Job, code: int) -> str | None:
    """The signal that stopped ``job`` when it was interrupted rather than failed: the run
    said so (it saved a checkpoint and names the signal it got), or its process ended on the
    signal the launcher sent it because the sweep was stopped."""
    exc = job.ret._return_value if job.ret is not None else None
    if isinstance(exc, RunInterrupted):
        return exc.signal or job.stop_signal or "a stop signal"
    if job.stop_signal is not None and job.ret is not None and job.ret.status == JobStatus.FAILED:
        try:
            return signal.Signals(-code).name if code < 0 else job.stop_signal
        except ValueError:
            return job.stop_signal
    return None


class _StopSignals:
    """While the sweep runs, SIGTERM/SIGINT ask it to stop: no new jobs, SIGTERM to the
    running ones (ddpexp saves a checkpoint), SIGKILL after the grace period."""

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
