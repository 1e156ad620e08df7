"""Rank and world bookkeeping, process-group set-up and teardown, free ports, seeds.

A worker learns who it is from the environment torch elastic (or SLURM) gives it, once, in
:func:`context_from_env`; everything else asks the resulting :class:`DistContext`.

Once the process group is up, :func:`with_mesh` lays the ranks out on a ``DeviceMesh`` with
named dimensions: ``dp`` (the replicas that train on different data) today, with room for a
model-parallel one (``tp``) beside it. What sizes batches, samplers and metrics asks the
context's ``dp_size`` and ``dp_rank``, never the world size: the ranks of one model-parallel
group see the same data, and only the first of them counts its samples.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist

from ddpexp.runtime.heartbeat import COLLECTIVE_MARGIN_S, ENV_SLOTS

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The mesh's dimensions, outermost first: data parallel, then model parallel.
DP, TP = "dp", "tp"


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    restart: int = 0
    # The ranks laid out by parallelism (with_mesh); None in a process without a group.
    mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        """How many replicas train on different data: the shards each split is cut into."""
        return self.mesh[DP].size() if self.mesh is not None else self.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's replica: which shard of each split it reads."""
        return self.mesh[DP].get_local_rank() if self.mesh is not None else self.rank

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel replicas, where it is not the whole
        world (a mesh with a model-parallel dimension); None where it is."""
        mesh = self.mesh
        if mesh is None or mesh.ndim == 1:
            return None
        return mesh[DP].get_group()

    @property
    def counts_samples(self) -> bool:
        """Whether this rank's samples count in sums over the world (metrics, losses): the
        first rank of each model-parallel group; every rank while there is none."""
        mesh = self.mesh
        if mesh is None or TP not in (mesh.mesh_dim_names or ()):
            return True
        return mesh[TP].get_local_rank() == 0

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only process that writes TensorBoard, checkpoints, metrics."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is (to be) set up."""
        return dist.is_available() and dist.is_initialized()


def context_from_env(gpus: int) -> DistContext:
    """Read RANK/LOCAL_RANK/WORLD_SIZE (set by torch elastic), or SLURM's equivalents."""
    env = os.environ
    if "RANK" in env:
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", 0))
        world, local_world = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", 1))
    elif "SLURM_PROCID" in env:
        rank, local_rank = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        world = int(env["SLURM_NTASKS"])
        local_world = int((env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
                           or "1").split("(")[0].split(",")[0])
    else:
        rank, local_rank, world, local_world = 0, 0, 1, 1
    device = torch.device("cpu")
    if gpus > 0:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    return DistContext(rank, local_rank, world, local_world, device, restart)


def init_process_group(ctx: DistContext, timeout_s: float, force: bool = False,
                       store: dist.Store | None = None) -> None:
    """NCCL on GPUs, gloo on CPUs, with a collective timeout so that a stuck rank fails the
    run instead of hanging it. With one process and ``force`` (strategy=ddp on one worker) an
    in-memory store is used, so no port is opened. ``store`` is one the ranks already share
    (a SLURM step's, on MASTER_PORT), used instead of opening another there."""
    if ctx.world_size == 1 and not force:
        return
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if os.environ.get(ENV_SLOTS):
        # The launching process's watchdog names a stalled rank after timeout_s; the
        # collectives wait a little longer, so that it acts first.
        timeout_s += COLLECTIVE_MARGIN_S
    timeout = timedelta(seconds=timeout_s)
    if ctx.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    kwargs: dict[str, Any] = {"device_id": ctx.device} if backend == "nccl" else {}
    if store is not None:
        kwargs["store"] = dist.PrefixStore("ddpexp/pg", store)
    elif ctx.restart > 0:
        # After an elastic restart the agent's store still holds the first round's keys
        # (the dead workers' gloo/NCCL addresses), and env:// would read them: the new
        # group then hangs connecting to ports nobody listens on. A prefix per restart
        # gives each round its own keys.
        kwargs["store"] = dist.PrefixStore(f"ddpexp/restart-{ctx.restart}", _env_store(ctx, timeout))
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timeout, **kwargs)


def with_mesh(ctx: DistContext, tp: int = 1) -> DistContext:
    """``ctx`` with its ranks on a ``DeviceMesh``: one ``dp`` dimension of ``world / tp``
    replicas, and a ``tp`` dimension inside it where ``tp > 1``. A process without a group
    (one worker, not forced) gets none. A 1-D mesh over the whole world is the default group
    itself: no new group is made."""
    if not (dist.is_available() and dist.is_initialized()):
        return ctx
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    if tp < 1 or ctx.world_size % tp:
        raise ValueError(f"a tensor-parallel degree of {tp} does not divide the world size "
                         f"{ctx.world_size}")
    shape, names = ((ctx.world_size,), (DP,)) if tp == 1 else \
        ((ctx.world_size // tp, tp), (DP, TP))
    return replace(ctx, mesh=init_device_mesh(ctx.device.type, shape, mesh_dim_names=names))


def regroup(ctx: DistContext, store: dist.Store, generation: int,
            timeout_s: float) -> DistContext:
    """Leave the current process group (one a failed collective left broken: its errors are
    ignored) and meet every rank in a new one, on ``store`` (the one the old group used,
    kept) under keys of its own ``generation``; ``ctx`` with the new group's mesh."""
    try:
        destroy_process_group()
    except Exception:  # an aborted or broken group: it is being left anyway
        pass
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": ctx.device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.PrefixStore(f"ddpexp/regroup-{generation}", store),
                            rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    from dataclasses import replace

    tp = ctx.mesh[TP].size() if ctx.mesh is not None and TP in (ctx.mesh.mesh_dim_names or ()) \
        else 1
    return with_mesh(replace(ctx, mesh=None), tp)


def _env_store(ctx: DistContext, timeout: timedelta) -> dist.Store:
    """A client of the store at MASTER_ADDR:MASTER_PORT (the elastic agent's, or rank 0's)."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         ctx.world_size, is_master=not agent_hosts and ctx.rank == 0,
                         timeout=timeout)


def destroy_process_group() -> None:
    """Tear down the process group if there is one (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def derive_seed(base: int, *parts: int) -> int:
    """A well-mixed 63-bit seed from the base seed and e.g. (rank,) or (rank, epoch)."""
    ss = np.random.SeedSequence([base, *parts])
    # Shifted as a Python int: numpy 1.x has no uint64 >> int64 (numpy 2 takes the 1 as uint64).
    return int(ss.generate_state(1, dtype=np.uint64)[0]) >> 1


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rng_state() -> dict:
    """This process's generator states, as tensors and ints only (``weights_only``-safe)."""
    np_state = cast(tuple, np.random.get_state())  # legacy=True (the default): a tuple
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
