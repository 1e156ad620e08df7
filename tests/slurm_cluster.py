"""A real one-node SLURM cluster on this machine, for the tests marked ``slurm``.

Debian's ``slurm-wlm`` (slurmctld, slurmd, the client commands) and ``munge`` are installed
with apt-get where they are missing (as root); :func:`start` writes a ``slurm.conf`` for this
one node under a temp dir (its own state and spool dirs, free ports, no accounting,
``proctrack/linuxproc``, ``task/none``), starts ``munged``, ``slurmctld`` and ``slurmd`` in
the foreground of processes this module owns, and :meth:`Cluster.stop` ends them by PID.
Clients reach it through ``SLURM_CONF`` in :meth:`Cluster.env`.

Run on its own (``python tests/slurm_cluster.py``) it starts the cluster, prints the
environment to use it, and stops it on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "squeue", "sinfo")
# The node is this machine under its own name, which its tasks resolve to reach rank 0.
NODE = socket.gethostname().split(".")[0]
# Tasks the node offers: more than the machine's cores, so that a 2-task step, a sweep's
# jobs and two steps side by side fit at once (the tests' runs are small).
CPUS = 8


class Unavailable(Exception):
    """SLURM cannot run here; the message says why (the tests are skipped with it)."""


def install() -> None:
    """apt-get the packages whose commands are missing (as root only)."""
    if all(shutil.which(b) for b in BINARIES):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        missing = [b for b in BINARIES if not shutil.which(b)]
        raise Unavailable(f"{', '.join(missing)} missing and not root with apt-get to install "
                          f"{' '.join(PACKAGES)}")
    from helpers.host import apt_lock

    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with apt_lock():
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:  # a clean image may have no package lists yet
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not all(shutil.which(b) for b in BINARIES):
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: "
                          + (done.stderr.strip().splitlines() or ["no output"])[-1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports nobody listens on (the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


SLURM_CONF = """\
ClusterName=ddpexp
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=30
KillWait=10
InactiveLimit=0
SchedulerParameters=sched_interval=1
MessageTimeout=20
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


@dataclass
class Cluster:
    """The running daemons and what clients need to reach them."""

    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self) -> dict[str, str]:
        """Environment for ``srun``/``sbatch``/submitit: this cluster's config, and no
        allocation of an outer SLURM job leaking in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A client command (``squeue``, ``scancel``...) against this cluster."""
        return subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def cancel_all(self) -> None:
        """scancel every job still known, and wait for them to leave the queue."""
        self.run("scancel", "--user", str(os.getuid()))
        deadline = time.time() + 30
        while time.time() < deadline and self.run("squeue", "-h", "-o", "%i").stdout.strip():
            time.sleep(0.5)

    def stop(self) -> None:
        """End the daemons by their PIDs (slurmd, slurmctld, munged), then remove the dir."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def _log_tail(self, name: str) -> str:
        texts = []
        for f in (self.root / f"{name}.out", self.root / f"{name}.log"):
            if f.exists():
                texts.append(f.read_text(errors="replace")[-1500:])
        return "\n".join(texts)


def start(timeout: float = 60) -> Cluster:
    """Install what is missing, write the config, start the daemons, wait for the node to be
    idle. Raises :class:`Unavailable` with the reason where that cannot be done."""
    install()
    if os.geteuid() != 0:
        raise Unavailable("slurmd must run as root to start jobs as their user")
    try:
        socket.gethostbyname(NODE)
    except OSError:
        raise Unavailable(f"this machine's name {NODE!r} does not resolve (the tasks of a step "
                          "reach rank 0 by the node's name)") from None
    root = Path(tempfile.mkdtemp(prefix="ddpexp-slurm-"))
    root.chmod(0o755)
    cluster = Cluster(root)
    try:
        _start(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start(cluster: Cluster, timeout: float) -> None:
    root = cluster.root
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = root / "munge" / "munge.socket"
    ctld_port, slurmd_port = _free_ports(2)
    cluster.conf.write_text(SLURM_CONF.format(
        host=socket.gethostname().split(".")[0], ctld_port=ctld_port, slurmd_port=slurmd_port,
        user="root", munge_socket=socket_path, root=root, node=NODE, cpus=CPUS,
        memory=_memory_mb() // 2))
    cluster._daemon("munged", [
        "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
        f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munge' / 'munged.log'}",
        f"--seed-file={root / 'munge' / 'munged.seed'}"])
    _wait(lambda: socket_path.exists(), timeout, "munged did not create its socket", cluster, "munged")
    cluster._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(cluster.conf)])
    _wait(lambda: cluster.run("sinfo", "-h").returncode == 0, timeout,
          "slurmctld did not answer", cluster, "slurmctld")
    cluster._daemon("slurmd", ["slurmd", "-D", "-f", str(cluster.conf)])
    _wait(lambda: cluster.run("sinfo", "-h", "-o", "%t").stdout.strip() == "idle", timeout,
          "the node did not become idle", cluster, "slurmd")


def _wait(ready, timeout: float, what: str, cluster: Cluster, name: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        proc = cluster.procs.get(name)
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.3)
    raise Unavailable(f"{what}:\n{cluster._log_tail(name)}")


if __name__ == "__main__":
    c = start()
    print(f"export SLURM_CONF={c.conf}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.cancel_all()
        c.stop()
