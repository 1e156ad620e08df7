"""What a Ray node runs for a sweep job of the ray launcher (:mod:`ddpexp.sweep.ray_backend`).

:class:`JobRunner` is made a Ray actor by the backend, one per bundle of the job's placement
group, holding that bundle's resources. Its :meth:`JobRunner.run` starts the job's processes
on its node and waits for them; :meth:`JobRunner.signal` (the actor takes two calls at once)
stops them. The job itself is the local backend's job process, ``python -m
ddpexp.sweep.job SPEC RESULT`` (:mod:`ddpexp.sweep.job`: Hydra's ``run_job`` on the pickled
task function and config), which fans out the job's ``trainer.procs`` workers on this node.
A job over several nodes is an env:// world (:mod:`ddpexp.launch.world`): every rank a
process with ``WORLD_SIZE``/``RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, global rank 0 the
job process, the others :func:`follow` the config rank 0 hands them
(:mod:`ddpexp.launch.ranks`).

Each process runs in a process group of its own, so that a signal reaches the job and the
workers it fans out, and is killed when the actor's process dies (a node going down takes
the job with it, as a real machine would).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

# prctl(2): deliver this signal to the process when its parent dies.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: a process group of its own, and SIGKILL when
    the actor's process (its parent) dies, where Linux offers it."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


# Kills a job's process group once the actor that started it is gone. The job's workers
# are the job process's children, not the actor's: SIGKILL on the actor's death ends the job
# process, and Ray ends the actor's own children as the actor exits, but not the workers.
# So the reaper is no child of the actor (it forks itself away first) and watches it by pid;
# it leaves by itself once the group is empty.
_REAPER = """import os, sys, time
if os.fork() > 0:
    os._exit(0)
actor, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(0.5)
    try:
        os.killpg(group, 0)
    except OSError:
        sys.exit(0)
    try:
        os.kill(actor, 0)
    except ProcessLookupError:
        try:
            os.killpg(group, 9)
        except OSError:
            pass
        sys.exit(0)
    except OSError:
        pass
"""


def _reaper(group: int) -> None:
    """Start the reaper of process group ``group`` (see ``_REAPER``)."""
    starter = subprocess.Popen([sys.executable, "-S", "-c", _REAPER, str(os.getpid()), str(group)],
                               start_new_session=True, stdin=subprocess.DEVNULL)
    starter.wait()  # it forks the reaper and exits at once


def free_port() -> int:
    """A TCP port that is free on this node now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class JobRunner:
    """The processes of one bundle of a sweep job, on the bundle's node."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.workdir = tempfile.mkdtemp(prefix="ddpexp-ray-job-")

    def where(self) -> tuple[str, int]:
        """This node's address as Ray knows it, and a port free on it (for rank 0's store)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def run(self, spec: bytes, env: dict[str, str], ranks: list[dict[str, str]]) -> dict[str, Any]:
        """Run the job's processes of this bundle: one per entry of ``ranks`` (the env://
        variables of each; one empty entry for a job on one node). Returns, once every one
        has ended, ``{"codes": [...], "result": bytes | None, "peak": int, "host": ...}``:
        the job process's JobReturn (cloudpickled, where it wrote one) and exit statuses."""
        spec_path = os.path.join(self.workdir, "job.spec")
        result_path = os.path.join(self.workdir, "job.result")
        with open(spec_path, "wb") as f:
            f.write(spec)
        base = {**os.environ, **env}
        # A Ray worker runs with Ray's own variables: none of them is the job's.
        base.pop("RAY_worker_niceness", None)
        for rank_env in ranks:
            lead = rank_env.get("RANK", "0") == "0"
            command = ([sys.executable, "-m", "ddpexp.sweep.job", spec_path, result_path] if lead
                       else [sys.executable, "-m", "ddpexp.sweep.ray_job"])
            proc_env = {**base, **rank_env}
            if not lead:
                # A follower imports ddpexp as this actor does.
                proc_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            self.procs.append(subprocess.Popen(command, env=proc_env,
                                               preexec_fn=_die_with_parent))
        for proc in self.procs:
            _reaper(proc.pid)
        codes = [p.wait() for p in self.procs]
        out: dict[str, Any] = {"codes": codes, "result": None, "peak": 0,
                               "host": socket.gethostname()}
        if os.path.isfile(result_path):
            with open(result_path, "rb") as f:
                out["result"] = f.read()
            try:
                import json

                with open(result_path + ".peak") as f:
                    out["peak"] = int(json.load(f)["peak_bytes"])
            except (OSError, ValueError, KeyError):
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        return out

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every process group of this bundle (SIGTERM: ddpexp saves a
        checkpoint and exits; SIGKILL: at once)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def ready(self) -> float:
        """Answers once the actor runs (its start-up took this long since the epoch)."""
        return time.time()


def cannot_write(directory: str) -> str | None:
    """Why this node cannot create a file in ``directory`` (the sweep dir), or None."""
    probe = os.path.join(directory, f".ddpexp-write-check-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        return f"{exc.strerror or exc}" + ("" if os.path.isdir(directory) else
                                           ": the directory does not exist there")
    return None


def follow() -> int:
    """A rank other than 0 of a job over several nodes: join rank 0's store, wait for the
    run's config, run as this rank (:func:`ddpexp.launch.ranks.follow`)."""
    from ddpexp.launch import ranks
    from ddpexp.launch.world import detect

    world = detect()
    if world is None:
        print("ddpexp.sweep.ray_job: no env:// world in this process's environment",
              file=sys.stderr)
        return 1
    ranks.quiet_torch_warnings()
    return ranks.follow(ranks.current(world))


if __name__ == "__main__":
    from ddpexp.launch.proc import exit_now

    exit_now(follow())
