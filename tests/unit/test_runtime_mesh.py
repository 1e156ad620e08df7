"""The run's device mesh (ddpexp.runtime.dist.with_mesh) in one process: none without a
process group, a 1-D data-parallel one with. Two ranks on a mesh: tests/e2e/test_mesh.py."""

from __future__ import annotations

import pytest

from ddpexp.runtime import dist as d


def test_without_a_group_there_is_no_mesh_and_dp_is_the_world():
    ctx = d.with_mesh(d.DistContext(rank=1, world_size=2))
    assert ctx.mesh is None and (ctx.dp_size, ctx.dp_rank, ctx.counts_samples) == (2, 1, True)


def test_one_process_gets_a_1d_mesh(gloo_group):
    ctx = d.with_mesh(d.DistContext())
    assert ctx.mesh is not None and ctx.mesh.mesh_dim_names == ("dp",)
    assert (ctx.dp_size, ctx.dp_rank, ctx.counts_samples) == (1, 0, True)
    with pytest.raises(ValueError, match="tensor-parallel degree of 2 does not divide the world size 1"):
        d.with_mesh(d.DistContext(), tp=2)
