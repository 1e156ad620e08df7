"""Who started the ranks: the launchers whose processes are already the ranks of one run.

ddpexp starts its own workers unless another launcher has started every rank already. Each
such launcher is recognised from the variables it sets, first match wins:

| launcher | recognised by | rendezvous |
|---|---|---|
| ddpexp's own workers | ``DDPEXP_WORKER`` (set by ddpexp's fan-out) | ddpexp's own |
| torchrun / torch elastic | ``TORCHELASTIC_RUN_ID`` (also inside srun or a pod) | the agent's store at ``MASTER_ADDR:MASTER_PORT`` (every rank a client) |
| MPI (``mpirun``, ``mpiexec``) | ``OMPI_COMM_WORLD_SIZE``, or MPICH's ``PMI_RANK``/``PMI_SIZE`` | ``MASTER_ADDR:MASTER_PORT`` if set; on one node 127.0.0.1 and a port from the MPI job's id |
| SLURM (``srun``) | ``SLURM_PROCID`` in a step of several tasks | the step's first node, a port from the job and step ids |
| env:// (a Kubernetes PyTorchJob) | ``WORLD_SIZE`` > 1 with ``RANK`` and ``MASTER_ADDR`` | ``MASTER_ADDR:MASTER_PORT``, hosted by rank 0 |
| nobody | otherwise | ddpexp fans out ``trainer.procs``/``gpus``/``nodes`` itself |

:func:`detect` returns the :class:`World` of this process (``None`` when ddpexp starts the
workers itself). A world of one process is no world: that process is an ordinary run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddpexp.errors import ConfigError

# SLURM_STEP_ID of a batch script's own step (and its extern step): the script is one
# process, however many tasks the allocation has.
_NOT_A_STEP = 0xFFFFFFF0
# The ports derived for a launcher that gives none: below Linux's ephemeral range
# (32768-60999), from which connections and the OS's "any free port" come.
PORT_BASE, PORT_SPAN = 20000, 12000
# Set in the workers ddpexp itself starts, so that a process they start is never taken for
# a rank of another launcher's world.
OWN_WORKER_ENV = "DDPEXP_WORKER"


@dataclass(frozen=True)
class World:
    """The ranks another launcher started, as this process sees them."""

    launcher: str  # "torchrun", "mpi", "slurm" or "env"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: int
    master_addr: str
    master_port: int
    # torchrun's agent hosts the store the ranks meet in: rank 0 joins it as a client.
    agent_store: bool = False
    # torchrun's restart round (0 for the first), and the id its rounds share.
    restart: int = 0
    run_id: str = ""

    @property
    def what(self) -> str:
        """The ranks, as a message names them."""
        return {"torchrun": "torchrun's workers", "mpi": "the MPI job's ranks",
                "slurm": "the SLURM step's tasks",
                "env": "the ranks of WORLD_SIZE/RANK (env://)"}[self.launcher]

    @property
    def label(self) -> str:
        """The workers, as the run's first lines count them: "2 worker(s) (SLURM tasks)"."""
        return {"torchrun": "torchrun workers", "mpi": "MPI ranks", "slurm": "SLURM tasks",
                "env": "env:// ranks"}[self.launcher]

    @property
    def whole(self) -> str:
        """What stops when a rank fails: "the whole SLURM step", "the whole run"."""
        return "the whole SLURM step" if self.launcher == "slurm" else "the whole run"

    def command(self) -> str:
        """What starts the same ranks again, up to the overrides: the launcher's own command
        line as it was typed (:func:`launcher_command`: every flag of ``torchrun`` or
        ``mpirun`` kept), else one made from the world: ``srun ... python -m ddpexp``,
        ``torchrun ... -m ddpexp``, ``mpirun -np N python -m ddpexp``."""
        typed = launcher_command()
        if typed is not None:
            return typed
        nodes = f"--nodes={self.nodes} " if self.nodes > 1 else ""
        if self.launcher == "slurm":
            return f"srun {nodes}--ntasks-per-node={self.local_world_size} python -m ddpexp"
        if self.launcher == "mpi":
            return f"mpirun -np {self.world_size} python -m ddpexp"
        if self.launcher == "torchrun":
            # Several nodes need the rendezvous flags they were started with, on each node.
            nodes = f"--nnodes={self.nodes} " if self.nodes > 1 else ""
            return f"torchrun {nodes}--nproc-per-node={self.local_world_size} -m ddpexp"
        return "python -m ddpexp"

    def env(self) -> dict[str, str]:
        """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun
        sets them, so that code that reads them (torch itself, a user's model) sees this world."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def launcher_command(pid: int | None = None) -> str | None:
    """The command line of the launcher that started this process (its parent, or
    ``pid``), up to ddpexp's own arguments, quoted for a shell; None where the parent's
    command line does not end with them (a wrapper script, a daemon such as ``orted`` or
    ``slurmstepd``) or cannot be read."""
    parent = os.getppid() if pid is None else pid
    try:
        raw = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return None
    words = launcher_prefix(raw.decode(errors="replace").split("\0")[:-1], sys.orig_argv)
    return None if words is None else shlex.join(words)


def launcher_prefix(launcher: Sequence[str], own: Sequence[str]) -> list[str] | None:
    """``launcher`` (a launcher's argv) up to the arguments it handed ddpexp, which ``own``
    (this process's argv: ``python [-u] -m ddpexp ARGS`` or ``.../ddpexp ARGS``) ends with:
    ``["torchrun", "--nproc-per-node=2", "-m", "ddpexp"]``. A Python interpreter that runs
    a console script (``python .../bin/torchrun``) is left out, and a program that ``PATH``
    finds as it is named is named so: the shell finds the same one again."""
    args = _ddpexp_args(own)
    if args is None or len(launcher) <= len(args) or list(launcher[len(launcher) - len(args):]) != args:
        return None
    words = list(launcher[:len(launcher) - len(args)])
    if len(words) > 1 and Path(words[0]).name.startswith("python") and \
            not words[1].startswith("-") and os.access(words[1], os.X_OK):
        words = words[1:]  # python /venv/bin/torchrun: the script's own shebang names it
    name = Path(words[0]).name
    if os.sep in words[0] and shutil.which(name) == words[0]:
        words[0] = name
    return words


def _ddpexp_args(own: Sequence[str]) -> list[str] | None:
    """The arguments of ``python [flags] -m ddpexp ARGS`` or ``.../ddpexp ARGS``."""
    if len(own) > 1 and not own[1].startswith("-"):
        return list(own[2:]) if Path(own[1]).name == "ddpexp" else None
    for i in range(1, len(own) - 1):  # the interpreter's own flags, up to its -m
        if own[i] == "-m":
            return list(own[i + 2:]) if own[i + 1].split(".")[0] == "ddpexp" else None
        if not own[i].startswith("-"):
            break
    return None


def detect(env: Mapping[str, str] | None = None) -> World | None:
    """This process's world (module docstring), or ``None`` when ddpexp starts the workers;
    one ConfigError when the variables contradict each other."""
    env = os.environ if env is None else env
    if env.get(OWN_WORKER_ENV):
        return None
    for find in (_torchrun, _mpi, _slurm, _env_vars):
        world = find(env)
        if world is not None:
            return world if world.world_size > 1 else None
    return None


def _int(env: Mapping[str, str], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = env.get(key)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r} is not a whole number") from None
    if default is None:
        raise ConfigError(f"{keys[0]} is not set")
    return default


def _torchrun(env: Mapping[str, str]) -> World | None:
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE", default=1)
    return World("torchrun", _int(env, "RANK"), _int(env, "LOCAL_RANK", default=0), world, local,
                 _int(env, "GROUP_WORLD_SIZE", default=max(1, world // max(1, local))),
                 env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT"),
                 agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                 restart=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0),
                 run_id=env.get("TORCHELASTIC_RUN_ID", ""))


def _mpi(env: Mapping[str, str]) -> World | None:
    if "OMPI_COMM_WORLD_SIZE" in env:
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=size)
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or ""
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID", default=0)
        local_size = _int(env, "MPI_LOCALNRANKS", default=size)
        job = env.get("PMI_KVSNAME") or env.get("PMIX_NAMESPACE") or ""
    else:
        return None
    nodes = max(1, -(-size // max(1, local_size)))
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr is None and nodes > 1 and size > 1:
        raise ConfigError(
            f"this MPI job has {size} ranks on {nodes} nodes: set MASTER_ADDR (the address of "
            "the node of rank 0) and MASTER_PORT (a free port there) for every rank, e.g. "
            "mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29400 ...")
    return World("mpi", rank, local, size, local_size, nodes, addr or "127.0.0.1",
                 int(port) if port else _derived_port(job))


def _slurm(env: Mapping[str, str]) -> World | None:
    if "SLURM_PROCID" not in env:
        return None
    try:
        step = int(env.get("SLURM_STEP_ID", "0"))
        if not (int(env.get("SLURM_NTASKS", "1")) > 1 and step < _NOT_A_STEP):
            return None
    except ValueError:
        return None
    world = _int(env, "SLURM_NTASKS")
    per_node = world
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):  # e.g. "2(x3)"
            per_node = int(env[key].split("(")[0].split(",")[0])
            break
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_STEP_NODELIST", env.get(
        "SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost"))))
    port = env.get("MASTER_PORT")
    job = _int(env, "SLURM_JOB_ID", default=0)
    return World("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID", default=0),
                 world, per_node, _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", default=1),
                 addr, int(port) if port else PORT_BASE + (job * 64 + step) % PORT_SPAN)


def _env_vars(env: Mapping[str, str]) -> World | None:
    if _int(env, "WORLD_SIZE", default=1) <= 1 or "RANK" not in env or "MASTER_ADDR" not in env:
        return None
    if _int(env, "PET_NPROC_PER_NODE", default=1) > 1:
        raise ConfigError(
            f"PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']} asks for several processes per pod, "
            "which torchrun starts: run `torchrun -m ddpexp ...` as the pod's command (it reads "
            "the PET_* variables); without it WORLD_SIZE counts processes while RANK counts pods")
    if "MASTER_PORT" not in env:
        raise ConfigError("WORLD_SIZE and RANK are set (env://) but MASTER_PORT is not: set it to "
                          "a free port on MASTER_ADDR, the same for every rank")
    size = _int(env, "WORLD_SIZE")
    local_size = _int(env, "LOCAL_WORLD_SIZE", default=1)
    return World("env", _int(env, "RANK"), _int(env, "LOCAL_RANK", default=0), size, local_size,
                 max(1, size // max(1, local_size)), env["MASTER_ADDR"], _int(env, "MASTER_PORT"))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        return "localhost"
    prefix, ranges = match.groups()
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def _derived_port(job: str) -> int:
    """A port every rank of one job computes alike without talking (two jobs side by side
    get different ones)."""
    return PORT_BASE + zlib.crc32(job.encode()) % PORT_SPAN
