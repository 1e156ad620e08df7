"""A sweep backend of the tests: every job a plain ``python -m ddpexp OVERRIDES
hydra.run.dir=JOB_DIR`` in a session of its own, ``hydra.launcher.max_parallel`` (default 1)
at once, its result read back from the ``metrics.json`` the run wrote. Nothing of the local
backend (no slices, no fork server, no pickled job): what an engine that only starts
commands somewhere gives the sweep driver."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from hydra.core.utils import JobReturn, JobStatus

from ddpexp.record import read_metrics_or_empty
from ddpexp.sweep.backend import Backend, Ended, Job, job_env
from ddpexp.sweep.settings import SweepSettings

log = logging.getLogger("hydra_plugins.ddpexp_launcher")


class SubprocessBackend(Backend):
    def __init__(self, settings: SweepSettings) -> None:
        self.parallel = settings.max_parallel or 1
        self.running: list[Job] = []

    def describe(self) -> str:
        return f"each job a python -m ddpexp of its own, up to {self.parallel} at once"

    @property
    def free(self) -> int:
        return self.parallel - len(self.running)

    def start(self, job: Job) -> bool:
        if self.free <= 0:
            return False
        job.started = time.time()
        command = [sys.executable, "-m", "ddpexp", *job.overrides, f"hydra.run.dir={job.dir}"]
        log.info("\t%s  [python -m ddpexp, run dir %s]", job.label, job.dir)
        job.handle = subprocess.Popen(command, env={**os.environ, **job_env(job)},
                                      start_new_session=True)
        self.running.append(job)
        return True

    def wait(self, timeout: float) -> list[Ended]:
        deadline = time.monotonic() + timeout
        while True:
            ended = [self._ended(j) for j in list(self.running) if j.handle.poll() is not None]
            left = deadline - time.monotonic()
            if ended or left <= 0:
                return ended
            time.sleep(min(0.1, left))

    def stop(self, job: Job, force: bool = False) -> None:
        try:
            os.killpg(job.handle.pid, signal.SIGKILL if force else signal.SIGTERM)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc: Any) -> None:
        for job in self.running:
            self.stop(job, force=True)

    def _ended(self, job: Job) -> Ended:
        self.running.remove(job)
        self.stop(job, force=True)  # nothing the run started outlives it
        code = job.handle.returncode
        metrics = read_metrics_or_empty(job.dir) if job.dir is not None else {}
        if code < 0:
            name = signal.Signals(-code).name
            return Ended(job, None, f"its process was killed by {name}", name)
        if code != 0:
            error = metrics.get("error")
            return Ended(job, None, f"python -m ddpexp exited with code {code}"
                                    + (f": {error}" if error else ""))
        monitor = metrics.get("monitor")
        value = (metrics.get("best") or {}).get(monitor) if monitor else None
        assert job.config is not None
        return Ended(job, JobReturn(overrides=job.overrides, cfg=job.config,
                                    working_dir=str(job.dir), task_name="ddpexp",
                                    status=JobStatus.COMPLETED, _return_value=value))
