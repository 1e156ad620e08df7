"""The run's device mesh (ddpexp.runtime.dist.with_mesh): the data-parallel size and rank that
samplers, the global batch and metrics read, and each sample counted once in a sum over a
model-parallel group. Two real gloo processes where it takes a group of two."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpexp.runtime import dist as d
from ddpexp.training.agreement import Agreement
from ddpexp.training.divergence import Divergence
from ddpexp.training.meters import RunningMeans


def test_without_a_group_there_is_no_mesh_and_dp_is_the_world():
    ctx = d.with_mesh(d.DistContext(rank=1, world_size=2))
    assert ctx.mesh is None and (ctx.dp_size, ctx.dp_rank, ctx.counts_samples) == (2, 1, True)


def test_one_process_gets_a_1d_mesh(gloo_group):
    ctx = d.with_mesh(d.DistContext())
    assert ctx.mesh is not None and ctx.mesh.mesh_dim_names == ("dp",)
    assert (ctx.dp_size, ctx.dp_rank, ctx.counts_samples) == (1, 0, True)
    with pytest.raises(ValueError, match="tensor-parallel degree of 2 does not divide the world size 1"):
        d.with_mesh(d.DistContext(), tp=2)


def _rank(rank: int, port: int, tp: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        ctx = d.with_mesh(d.DistContext(rank=rank, world_size=2), tp=tp)
        agreement = Agreement(rank, 2, torch.device("cpu"), Divergence(None),
                              counts=ctx.counts_samples)
        # Both ranks of a tp group hold the same 3 samples' loss sum: it counts once.
        total, seen = agreement.reduce((torch.tensor(6.0), 3.0), RunningMeans(torch.device("cpu")), 0, 0)
        group = ctx.dp_group  # the whole world's where there is no tp dimension
        replicas = None if group is None else dist.get_world_size(group)
        out.put((rank, ctx.dp_size, ctx.dp_rank, ctx.counts_samples, total, seen, replicas))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,expected", [
    (1, {0: (2, 0, True, 12.0, 6.0, None), 1: (2, 1, True, 12.0, 6.0, None)}),  # two replicas
    (2, {0: (1, 0, True, 6.0, 3.0, 1), 1: (1, 0, False, 6.0, 3.0, 1)}),  # one, split in two
])
def test_two_ranks_on_a_mesh(tp, expected):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = d.free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, tp, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, *rest = out.get(timeout=60)
            got[rank] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == expected
    assert all(p.exitcode == 0 for p in procs)
