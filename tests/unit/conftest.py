"""Fixtures of the unit layer: in-process parts only (no process is started by any test).

Global state that a test may leave behind is reset here: Hydra's GlobalHydra and the run
dirs this process claimed (``ddpexp.config.rundir._CLAIMED``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _fresh_globals():
    """Each test starts with no Hydra initialised and no claimed run dirs."""
    from hydra.core.global_hydra import GlobalHydra

    from ddpexp.config import rundir

    claimed = dict(rundir._CLAIMED)
    rundir._CLAIMED.clear()
    yield
    rundir._CLAIMED.clear()
    rundir._CLAIMED.update(claimed)
    GlobalHydra.instance().clear()


@pytest.fixture
def gloo_group():
    """A real one-process gloo group on an in-memory store (no port is opened)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def trainer_config():
    """A factory of typed trainer configs: ``trainer_config(strategy="ddp", ...)``."""
    from ddpexp.config.schema import trainer_config as typed

    def make(**values):
        return typed(values)

    return make


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
