"""What the machine can give a run: memory for its workers, cores, and whether the kernel's
out-of-memory killer has struck. Read from ``/proc`` and cgroup v2 files, where they exist;
elsewhere every check passes silently."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")


# What one CPU worker process at least takes (torch, the data, the model); measured at
# 0.5 GB resident on Linux, part of which the workers share.
WORKER_MEMORY_BYTES = 300 * 2**20


def check_resources(plan: Any, available: int | None = None, cores: int | None = None) -> None:
    """Refuse a layout whose workers cannot fit in this node's memory (they would thrash,
    then meet the kernel's out-of-memory killer); warn when they outnumber the cores."""
    if plan.procs <= 1:
        return
    available = memory_available() if available is None else available
    need = plan.procs * WORKER_MEMORY_BYTES
    if available is not None and need > available:
        fit = max(1, available // WORKER_MEMORY_BYTES)
        raise ConfigError(
            f"trainer.procs={plan.procs} starts {plan.procs} worker processes, at least "
            f"{need / 2**30:.1f} GiB of memory at ~{WORKER_MEMORY_BYTES >> 20} MiB each, but "
            f"{available / 2**30:.1f} GiB is available; use trainer.procs={min(fit, plan.procs - 1)} "
            "or fewer"
        )
    if cores is None:
        cores = node_cores()
    if cores and plan.gpus == 0 and plan.procs > cores:
        log.warning("trainer.procs=%d CPU workers on %d core(s): they will take turns on the cores "
                    "and train slower than trainer.procs=%d would", plan.procs, cores, cores)


def node_cores(launched_elsewhere: bool = False) -> int | None:
    """How many cores the workers of this node may use: this process's affinity mask (a
    sweep slice, a cgroup's cpuset). With ``launched_elsewhere``, where each rank is a
    process that another launcher started, the launcher's own mask counts too: mpirun binds
    every rank to a core of its own (``--bind-to core``), so one rank's mask is one core even
    though its peers have theirs, while the launcher (unbound) sees every core it gives out."""
    if not hasattr(os, "sched_getaffinity"):
        return os.cpu_count()
    cores = set(os.sched_getaffinity(0))
    if launched_elsewhere:
        try:
            cores |= os.sched_getaffinity(os.getppid())
        except OSError:
            pass
    return len(cores)


def memory_available() -> int | None:
    """Bytes this process's cgroup and the machine can still give, or None if unknown."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def oom_kills() -> int | None:
    """How many processes of this cgroup the kernel's OOM killer has killed (cgroup v2),
    or None where that is not known."""
    try:
        text = Path("/sys/fs/cgroup/memory.events").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None
