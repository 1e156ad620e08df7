"""Rank bookkeeping, seeds, ports and generator states (runtime/dist.py)."""

from __future__ import annotations

import random
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddpexp.runtime import dist as d


def test_context_defaults():
    ctx = d.DistContext()
    assert (ctx.rank, ctx.world_size, ctx.device) == (0, 1, torch.device("cpu"))
    assert ctx.is_main and not ctx.distributed


def test_context_is_main_only_rank_zero():
    assert not d.DistContext(rank=1, world_size=2).is_main


def test_context_is_frozen():
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError, match="cannot assign to field 'rank'"):
        d.DistContext().rank = 3


def test_distributed_with_group(gloo_group):
    assert d.DistContext().distributed


def test_context_from_torch_elastic_env(monkeypatch):
    for k, v in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                 "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(k, v)
    ctx = d.context_from_env(gpus=0)
    assert ctx == d.DistContext(3, 1, 4, 2, torch.device("cpu"), 2)


def test_context_from_slurm_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for k, v in {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                 "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}.items():
        monkeypatch.setenv(k, v)
    ctx = d.context_from_env(gpus=0)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size, ctx.restart) == (5, 1, 8, 4, 0)


def test_context_from_empty_env(monkeypatch):
    for k in ("RANK", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert d.context_from_env(gpus=0) == d.DistContext()


def test_init_process_group_one_process_not_forced():
    d.init_process_group(d.DistContext(), timeout_s=5)
    assert not dist.is_initialized()


def test_init_process_group_forced_uses_in_memory_store():
    d.init_process_group(d.DistContext(), timeout_s=5, force=True)
    try:
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    finally:
        d.destroy_process_group()
    assert not dist.is_initialized()
    d.destroy_process_group()  # twice is safe


def test_free_port_is_bindable():
    port = d.free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_derive_seed_deterministic_and_distinct():
    a = d.derive_seed(0, 1)
    assert a == d.derive_seed(0, 1)
    # the seeds the run derives: loaders (seed, rank), the per-rank stream (seed, rank, 1),
    # each epoch's generator (seed, rank, epoch, 2)
    used = [d.derive_seed(0, r) for r in range(3)] + [d.derive_seed(0, r, 1) for r in range(3)]
    used += [d.derive_seed(0, r, e, 2) for r in range(3) for e in range(3)]
    assert len(set(used)) == len(used)
    assert 0 <= a < 2**63


@pytest.mark.xfail(strict=True, reason="derive_seed feeds its parts to numpy's SeedSequence, "
                   "which ignores trailing zeros: (base, rank, 0) gives the seed of (base, rank)")
def test_derive_seed_trailing_zero_part_is_a_different_stream():
    assert d.derive_seed(5, 1, 0) != d.derive_seed(5, 1)


def test_derive_seed_matches_seed_sequence():
    expected = int(np.random.SeedSequence([7, 2, 3]).generate_state(1, dtype=np.uint64)[0]) >> 1
    assert d.derive_seed(7, 2, 3) == expected


def test_seed_everything_seeds_all_generators():
    d.seed_everything(2**40 + 5)
    first = (torch.rand(2).tolist(), np.random.rand(), random.random())
    d.seed_everything(2**40 + 5)
    assert (torch.rand(2).tolist(), np.random.rand(), random.random()) == first


def test_rng_state_round_trip_is_weights_only_safe(tmp_path):
    d.seed_everything(3)
    state = d.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    want = (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random())
    d.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()) == want
