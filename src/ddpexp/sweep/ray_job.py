"""What a Ray node runs for a sweep job of the ray launcher (:mod:`ddpexp.sweep.ray_backend`).

:class:`NodeAgent` is made a Ray actor by the backend, one per node of the cluster for the
whole sweep, holding no resources of its own: each job's placement groups hold the job's
CPUs and GPUs, and the agent of the node they are on runs the job's processes there.
Its :meth:`NodeAgent.run` starts them and waits for them; :meth:`NodeAgent.signal` stops
them. The job itself is the local backend's job process (:mod:`ddpexp.sweep.job`: Hydra's
``run_job`` on the pickled task function and config), forked from the agent's fork server
(:mod:`ddpexp.sweep.forkserver`), which has imported torch, Hydra and ddpexp once for the
sweep; it fans out the job's ``trainer.procs`` workers on this node. A job over several
nodes is an env:// world (:mod:`ddpexp.launch.world`): every rank a process with
``WORLD_SIZE``/``RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, global rank 0 the job process,
the others :func:`follow` the config rank 0 hands them (:mod:`ddpexp.launch.ranks`).

Each process runs in a process group of its own, so that a signal reaches the job and the
workers it fans out, and is killed when the agent's process dies (a node going down takes
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
import threading
import time
from pathlib import Path
from typing import Any

# This module's import name (it also runs as ``python -m``, as ``__main__``): the fork
# server imports it, and forks the ranks other than 0 of a job into :func:`follow`.
MODULE = "ddpexp.sweep.ray_job"
# prctl(2): deliver this signal to the process when its parent dies.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: a process group of its own, and SIGKILL when
    the agent's process (its parent) dies, where Linux offers it."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


# Kills a job's process group once the agent that started it is gone. The job's processes
# are the fork server's children (or, started afresh, the agent's), and its workers theirs:
# none of them ends by itself with the agent. So the reaper is no child of the agent (it
# forks itself away first) and watches it by pid; it leaves by itself once the group is
# empty.
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


class NodeAgent:
    """A node's share of the sweep: one actor per node (``num_cpus=0``), for the whole sweep,
    that runs the processes of every job with CPUs reserved on the node and stops them when asked.

    It starts a fork server (:mod:`ddpexp.sweep.forkserver`) when the sweep's first jobs
    are about to start (:meth:`warm`), which imports torch, Hydra and ddpexp once; every job
    process (and every rank of a job over several
    nodes) is then forked from it in milliseconds rather than being a fresh interpreter that
    imports them again. Where the server cannot fork (it did not start, or is not safe to
    fork), the process starts as a fresh interpreter, as a sweep without forking would. Calls
    run on the actor's threads: one :meth:`run` per job in progress, :meth:`signal` beside
    them."""

    def __init__(self) -> None:
        # The server and what it forks import ddpexp as this actor does, and run at its
        # niceness (normal: the actor's runtime env asks for it).
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        os.environ.pop("RAY_worker_niceness", None)
        self.server: Any = None
        self.procs: dict[str, list[Any]] = {}
        # Signals asked for a job before its processes started: sent as they start.
        self.early: dict[str, int] = {}
        self.lock = threading.Lock()

    def warm(self) -> None:
        """Start the fork server (once): its imports run while the jobs are placed."""
        from ddpexp.sweep.forkserver import ForkServer

        with self.lock:
            if self.server is None:
                self.server = ForkServer(preload=[MODULE])
                self.server.start()

    def where(self) -> tuple[str, int]:
        """This node's address as Ray knows it, and a port free on it (for rank 0's store)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def cannot_write(self, directory: str) -> str | None:
        """Why this node cannot write the sweep dir, or None (:func:`cannot_write`)."""
        return cannot_write(directory)

    def run(self, key: str, spec: bytes, env: dict[str, str], ranks: list[dict[str, str]],
            gpu_ids: list[str] | None = None) -> dict[str, Any]:
        """Run job ``key``'s processes of this node: one per entry of ``ranks`` (the env://
        variables of each; one empty entry for a job on one node), with ``gpu_ids`` (the GPUs
        reserved for it on this node) visible. Returns, once every one has ended,
        ``{"codes": [...], "result": bytes | None, "peak": int, "host": ...}``: the job
        process's JobReturn (cloudpickled, where it wrote one) and exit statuses."""
        workdir = tempfile.mkdtemp(prefix="ddpexp-ray-job-")
        spec_path = os.path.join(workdir, "job.spec")
        result_path = os.path.join(workdir, "job.result")
        with open(spec_path, "wb") as f:
            f.write(spec)
        base = {**os.environ, **env}
        if gpu_ids is not None:
            base["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        self.warm()
        self.server.wait_ready()
        procs: list[Any] = []
        try:
            for rank_env in ranks:
                lead = rank_env.get("RANK", "0") == "0"
                with self.lock:
                    proc = self.server.spawn(Path(spec_path), Path(result_path),
                                             {**base, **rank_env},
                                             call=None if lead else f"{MODULE}:follow")
                    if proc is None:
                        command = ([sys.executable, "-m", "ddpexp.sweep.job", spec_path,
                                    result_path] if lead
                                   else [sys.executable, "-m", "ddpexp.sweep.ray_job"])
                        proc = subprocess.Popen(command, env={**base, **rank_env},
                                                preexec_fn=_die_with_parent)
                    procs.append(proc)
                    self.procs[key] = procs
                    early = self.early.pop(key, None)
                _reaper(proc.pid)
                if early is not None:
                    self.signal(key, early)
            while any(p.poll() is None for p in procs):
                time.sleep(0.05)
        finally:
            with self.lock:
                self.procs.pop(key, None)
                self.early.pop(key, None)
        out: dict[str, Any] = {"codes": [p.returncode for p in procs], "result": None,
                               "peak": 0, "host": socket.gethostname()}
        if os.path.isfile(result_path):
            with open(result_path, "rb") as f:
                out["result"] = f.read()
            try:
                import json

                with open(result_path + ".peak") as f:
                    out["peak"] = int(json.load(f)["peak_bytes"])
            except (OSError, ValueError, KeyError):
                pass
        shutil.rmtree(workdir, ignore_errors=True)
        return out

    def signal(self, key: str, signum: int) -> None:
        """Send ``signum`` to every process group of job ``key`` (SIGTERM: ddpexp saves a
        checkpoint and exits; SIGKILL: at once); to a job whose processes are starting, as
        they start."""
        with self.lock:
            procs = self.procs.get(key)
            if procs is None:
                self.early[key] = signum
                return
            procs = list(procs)
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def close(self) -> None:
        """End the fork server (the sweep is over: no job of it runs here any more)."""
        with self.lock:
            if self.server is not None:
                self.server.discard()


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
