"""The run's device mesh on two real gloo processes: the data-parallel size and rank that
samplers, the global batch and metrics read, the dp group whole-split metrics join, and each
sample counted once in a sum over a model-parallel group."""

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
    ctx = mp.get_context("spawn")  # fresh interpreters: a fork of a test process may hang
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
