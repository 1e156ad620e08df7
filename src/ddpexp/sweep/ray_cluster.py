"""What a Ray sweep's jobs need and what the cluster has, for the Ray backend
(:mod:`ddpexp.sweep.ray_backend`): a job's size in CPUs and GPUs per node (:class:`Need`), the
cluster's nodes and their room (:class:`Node`), whether a job fits, the address probe that
refuses a cluster that does not answer, the :class:`Unit` s a sweep holds (one-bundle
placement groups pinned to a node) and a job's handle on them (:class:`Placed`), and the
env:// variables of a job's ranks over several nodes (:func:`world_ranks`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from ddpexp.errors import ConfigError
from ddpexp.sweep.backend import Job

# How long an address may take to answer before the sweep is refused, and how long a
# refused connection is tried again (a head that is starting opens its port within seconds).
CONNECT_TIMEOUT_S = 30.0
REFUSED_RETRY_S = 5.0

@dataclass(frozen=True)
class Need:
    """What a job reserves: ``nodes`` bundles of ``cpus`` CPUs and ``gpus`` GPUs, each on a
    node of its own."""

    cpus: int
    gpus: int = 0
    nodes: int = 1

    def units(self) -> tuple[int, int]:
        """The units it holds on each of its nodes: ``(with a GPU, CPU only)``."""
        return self.gpus, self.cpus - self.gpus

    def describe(self) -> str:
        one = amount(self.cpus, self.gpus)
        return one + " on one node" if self.nodes == 1 else f"{one} on each of {self.nodes} nodes"


@dataclass
class Node:
    """A node of the cluster: its id, address and size, and what this sweep's jobs hold."""

    id: str
    ip: str
    cpus: float
    gpus: float = 0.0
    used_cpus: float = 0.0
    used_gpus: float = 0.0

    def fits(self, need: Need, free: bool = True) -> bool:
        cpus = self.cpus - (self.used_cpus if free else 0)
        gpus = self.gpus - (self.used_gpus if free else 0)
        return cpus >= need.cpus and gpus >= need.gpus


def amount(cpus: float, gpus: float) -> str:
    text = f"{cpus:g} CPU{'s' if cpus != 1 else ''}"
    return text + (f" and {gpus:g} GPU{'s' if gpus != 1 else ''}" if gpus else "")


def need_of(job: Job) -> Need:
    """The job's reservation, from its config (workers per node, GPUs per node, nodes)."""
    nodes = int(OmegaConf.select(job.config, "trainer.nodes", default=1) or 1) if job.config else 1
    return Need(max(1, job.workers, job.gpus), job.gpus, max(1, nodes))


def fits(need: Need, nodes: Sequence[Node], free: bool = True) -> bool:
    """Whether ``need`` fits on ``nodes`` (as they are now, or, ``free=False``, empty)."""
    return sum(n.fits(need, free) for n in nodes) >= need.nodes


def too_large(need: Need, nodes: Sequence[Node]) -> str | None:
    """Why no node of the cluster (or not enough of them) could ever hold a job of ``need``,
    naming the nodes' sizes; None when it fits the empty cluster."""
    if fits(need, nodes, free=False):
        return None
    sizes = ", ".join(f"{n.ip} {amount(n.cpus, n.gpus)}" for n in nodes) or "none"
    return (f"it asks for {need.describe()}, more than the Ray cluster has (its nodes: "
            f"{sizes}): ask for fewer trainer.procs or trainer.gpus (or trainer.nodes), or add "
            "nodes that large")


def nodes_of(listing: Sequence[dict[str, Any]]) -> list[Node]:
    """The alive nodes of ``ray.nodes()``, with the CPUs and GPUs each has."""
    out = []
    for entry in listing:
        if not entry.get("Alive"):
            continue
        res = entry.get("Resources") or {}
        out.append(Node(str(entry["NodeID"]), str(entry.get("NodeManagerAddress", "?")),
                        float(res.get("CPU", 0)), float(res.get("GPU", 0))))
    return out


def probe(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse an address where nothing listens, within ``timeout`` seconds, with one
    message naming it. ``auto`` is left to Ray (it looks for a cluster of this machine)."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"hydra.launcher.address={address} is not a Ray address: use auto, "
                          "HOST:PORT (the head's GCS port, 6379 by default) or ray://HOST:PORT "
                          "(Ray Client, 10001)")
    began = time.monotonic()
    deadline = began + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout)):
                return
        except OSError as exc:
            # A refused connection is retried only as long as a head takes to open its
            # port; an address that does not answer at all, up to the whole bound.
            refused = isinstance(exc, ConnectionRefusedError)
            if (time.monotonic() >= deadline - 1.0
                    or (refused and time.monotonic() - began >= REFUSED_RETRY_S)):
                waited = time.monotonic() - began
                raise ConfigError(
                    f"hydra.launcher.address={address}: no Ray cluster answers there "
                    f"({exc.strerror or exc}, for {waited:.0f} s). Start one (ray start --head) "
                    "or give the address of its head (ray status prints it)") from None
            time.sleep(1.0)


@dataclass(eq=False)
class Unit:
    """A CPU of a node (and a GPU of it, ``gpu``) that the sweep holds: a placement group of
    one bundle, pinned to the node."""

    node: str
    gpu: bool
    pg: Any
    # The GPU Ray gave the bundle, once asked; when the unit was last given back by a job.
    gpu_id: str | None = None
    idle_since: float = 0.0


@dataclass
class Placed:
    """The Ray backend's handle on a job (``Job.handle``)."""

    need: Need
    # Its units by node of the job (rank 0's first), once reserved; their nodes' agents and
    # the agents' run() refs, once launched.
    units: list[list[Unit]] = field(default_factory=list)
    agents: list[Any] = field(default_factory=list)
    runs: list[Any] = field(default_factory=list)
    # The job's name with its agents (its index and attempt).
    key: str = ""
    attempt: int = 0
    # To be placed again after a node died (retries): not yet launched.
    replacing: bool = False

    @property
    def nodes(self) -> list[str]:
        return [units[0].node for units in self.units]


def world_ranks(need: Need, addr: str, port: int) -> list[list[dict[str, str]]]:
    """The env:// variables of every rank of a job over several nodes, by node: node i's
    ranks are ``i * cpus ... i * cpus + cpus - 1`` (one per worker), rank 0 on the first."""
    per_node = max(1, need.gpus or need.cpus)
    size = per_node * need.nodes
    return [[{"WORLD_SIZE": str(size), "RANK": str(node * per_node + local),
              "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_node),
              "NODE_RANK": str(node), "GROUP_RANK": str(node),
              "MASTER_ADDR": addr, "MASTER_PORT": str(port)} for local in range(per_node)]
            for node in range(need.nodes)]


def remove_group(pg: Any) -> None:
    """Give a placement group back to the cluster (one that is gone already is no error)."""
    from ray.util import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:
        pass
