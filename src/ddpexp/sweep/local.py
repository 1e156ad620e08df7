"""The local backend (:mod:`ddpexp.sweep.backend`) of the ddp launcher
(``hydra_plugins.ddpexp_launcher``): every sweep job a process on this machine.

Every job runs in its own process (:mod:`ddpexp.sweep.job`), in its own process group, so
that a job and every worker it fans out can be stopped together. Up to ``max_parallel`` jobs
run at once, each on its own slice of the machine: a disjoint set of CPU cores (its
affinity, which its workers inherit, and matching OpenMP/MKL thread counts) and, for a job
with ``trainer.gpus=N``, N GPUs of its own through ``CUDA_VISIBLE_DEVICES``. A job that needs
more than is free waits. With ``max_parallel: null`` jobs of different sizes pack the
machine (:class:`Packing`). Jobs are forked from a server that has imported torch, Hydra and
ddpexp (:mod:`ddpexp.sweep.forkserver`), or start as fresh interpreters.

What a job's ending means, time limits, ``fail_fast`` and the summary are the driver's
(:mod:`ddpexp.sweep.driver`).
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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddpexp.sweep.backend import Backend, Ended, HydraSetup, Job, job_env, payload
from ddpexp.sweep.forkserver import ForkedJob, ForkServer, adopt_early, discard_early
from ddpexp.sweep.settings import LocalSettings, SweepSettings

log = logging.getLogger("hydra_plugins.ddpexp_launcher")

POLL_S = 0.1


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


def make_slices(settings: SweepSettings) -> Slices | Packing:
    """The sweep's way of sharing the machine: K equal slices for ``max_parallel=K``,
    packing for ``max_parallel: null``."""
    parallel = settings.max_parallel
    return Packing([]) if parallel is None else Slices(parallel, [])


def _gpu_pool(limit: int | None) -> list[str]:
    """The GPU ids this sweep may hand out (entries of CUDA_VISIBLE_DEVICES if set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ids if limit is None else ids[: max(0, int(limit))]


# ------------------------------------------------------------------------------ the backend
@dataclass
class Process:
    """The local backend's handle on a job it started (``Job.handle``)."""

    proc: subprocess.Popen | ForkedJob
    # The (cores, GPU ids) it holds.
    taken: tuple
    # Its spec, its result, and the peak memory written beside the result.
    files: list[str]


class LocalBackend(Backend):
    """Jobs as processes on the machine's slices: :meth:`start` puts a job on a free slice,
    :meth:`wait` polls the running ones; :meth:`stop` signals a job's process group
    (SIGTERM, or SIGKILL with ``force``)."""

    def __init__(self, settings: LocalSettings, hydra: HydraSetup) -> None:
        self.settings, self.hydra = settings, hydra
        self.slices = make_slices(settings)
        self.running: list[Job] = []
        self._gpus_known = False
        self._workdir: Path | None = None
        self._server: ForkServer | None = None

    def prepare(self) -> None:
        """Start the fork server, so that its imports run while the caller prepares the jobs
        (``__enter__`` starts it where the caller did not)."""
        self._start_server()

    def _start_server(self) -> None:
        if self._server is None and not self.settings.fork:
            discard_early()  # hydra.launcher.fork=false set in a config file
        elif self._server is None:
            # ddpexp's own app (its config has a trainer): torch and the run, preloaded.
            ddpexp_app = OmegaConf.select(self.hydra.config, "trainer") is not None
            preload = self.settings.preload
            # The command's own, started as it began (ddpexp.__main__), where it fits.
            self._server = adopt_early(preload, torch=ddpexp_app)
            if self._server is None:
                self._server = ForkServer(preload, torch=ddpexp_app)
                self._server.start()

    def __enter__(self) -> LocalBackend:
        self._workdir = Path(tempfile.mkdtemp(prefix="ddp-launcher-"))
        self._start_server()
        if self._server is not None:
            self._server.wait_ready()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            # An exception in the caller: nothing of its jobs may outlive the sweep.
            for job in self.running:
                _signal_group(job, signal.SIGKILL)
        finally:
            if self._server is not None:
                self._server.close()
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)

    def describe(self) -> str:
        return self.slices.describe()

    @property
    def free(self) -> int:
        """Free core slices, or free cores when packing (a job also needs its GPUs, and its
        cores when packing, free to start)."""
        return self.slices.free

    def start(self, job: Job) -> bool:
        """Start ``job`` on a free slice; False (nothing started) when none fits it now."""
        if job.gpus > 0 and not self._gpus_known:
            # Only a sweep that asks for GPUs looks for them (and imports torch to count them).
            self.slices.add_gpus(_gpu_pool(self.settings.gpus))
            self._gpus_known = True
        taken = self.slices.take(job.gpus, job.workers)
        if taken is None:
            return False
        assert self._workdir is not None, "LocalBackend.start() outside its with block"
        _start(self.hydra, job, taken, self.slices.split, self._workdir, self._server)
        self.running.append(job)
        return True

    def wait(self, timeout: float) -> list[Ended]:
        """The jobs whose process ended, each with its slice given back, polling for up to
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        server = self._server
        while True:
            told = server.exits_told if server is not None else 0
            ended = []
            for job in list(self.running):
                if job.handle.proc.poll() is not None:
                    ended.append(_ended(job))
                    if isinstance(self.slices, Packing):
                        self.slices.saw_peak(_peak(Path(job.handle.files[1])))
                    self.slices.give_back(*job.handle.taken)
                    self.running.remove(job)
            left = deadline - time.monotonic()
            if ended or left <= 0:
                return ended
            if server is not None and all(isinstance(j.handle.proc, ForkedJob)
                                          for j in self.running):
                server.wait_exit(told, min(POLL_S, left))  # woken by the exit itself
            else:
                time.sleep(min(POLL_S, left))

    def stop(self, job: Job, force: bool = False) -> None:
        _signal_group(job, signal.SIGKILL if force else signal.SIGTERM)


def _start(hydra: HydraSetup, job: Job, taken: tuple, split: bool, workdir: Path,
           server: ForkServer | None = None) -> None:
    """Write the job's spec and start its process: forked by ``server`` where it can,
    else a fresh ``python -m ddpexp.sweep.job``."""
    import cloudpickle

    cores, gpu_ids = taken
    spec_path, result_path = workdir / f"job-{job.idx}.spec", workdir / f"job-{job.idx}.result"
    with open(spec_path, "wb") as f:
        pickle.dump({"sys_path": list(sys.path), "cores": cores if split else []}, f)
        cloudpickle.dump(payload(hydra, job), f)
    job.started = time.time()
    env = {**os.environ, **job_env(job)}
    if split and cores:
        # Workers split these further (ddpexp.launch.worker.set_threads divides the affinity mask).
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(len(cores))
    if job.gpus > 0:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    log.info("\t%s%s", job.label, _where(cores if split else [], gpu_ids))
    files = [str(spec_path), str(result_path), f"{result_path}.peak"]
    # Its own process group (same session): one killpg stops the job and all its workers.
    group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                             else {"preexec_fn": os.setpgrp})
    forked = server.spawn(spec_path, result_path, env) if server is not None else None
    proc = forked or subprocess.Popen(
        [sys.executable, "-m", "ddpexp.sweep.job", str(spec_path), str(result_path)],
        env=env, **group,
    )
    job.handle = Process(proc, taken, files)


def _where(cores: list[int], gpu_ids: list[str]) -> str:
    parts = []
    if cores:
        parts.append("cores " + ",".join(map(str, cores)))
    if gpu_ids:
        parts.append("GPUs " + ",".join(gpu_ids))
    return f"  [{'; '.join(parts)}]" if parts else ""


def _signal_group(job: Job, sig: int) -> None:
    try:
        os.killpg(job.handle.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ended(job: Job) -> Ended:
    """What the job's process left: its JobReturn, or how it died without one."""
    code = job.handle.proc.returncode
    # Workers of a job that died abruptly may outlive it: nothing of a job survives it.
    _signal_group(job, signal.SIGKILL)
    result_path = Path(job.handle.files[1])
    killed_by = _signal_name(-code) if code < 0 else None
    if result_path.is_file():
        import cloudpickle

        try:
            return Ended(job, cloudpickle.loads(result_path.read_bytes()), signal=killed_by)
        except Exception:
            pass  # a torn result: said as a process that left none
    if code < 0:
        why = f"its process was killed by {killed_by or f'signal {-code}'}"
    else:
        why = f"its process exited with code {code} without a result"
    return Ended(job, None, why, killed_by)


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _peak(result_path: Path) -> int:
    """The peak memory a job wrote beside its result (:func:`ddpexp.sweep.job.peak_bytes`)."""
    try:
        return int(json.loads(Path(f"{result_path}.peak").read_text())["peak_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
