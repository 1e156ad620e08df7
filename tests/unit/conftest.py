"""Fixtures of the unit layer: in-process parts only (no process is started by any test).

Global state that a test may leave behind is reset here: Hydra's GlobalHydra, the run
dirs this process claimed (``ddpexp.config.rundir._CLAIMED``) and the run-dir locks it holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _fresh_globals():
    """Each test starts with no Hydra initialised and no claimed run dirs."""
    from hydra.core.global_hydra import GlobalHydra

    from ddpexp.config import rundir, runlock

    claimed = dict(rundir._CLAIMED)
    rundir._CLAIMED.clear()
    yield
    runlock.release_all()
    runlock._REFUSED.clear()
    rundir._CLAIMED.clear()
    rundir._CLAIMED.update(claimed)
    GlobalHydra.instance().clear()


def _children() -> set[int]:
    """This process's live child processes (every thread's), from /proc."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            found |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def _no_process_started():
    """The unit layer runs in this process only: a test that leaves a child process behind
    (a DataLoader worker, a subprocess, a forked rank) fails."""
    before = _children()
    yield
    left = _children() - before
    assert not left, f"the test left child processes {sorted(left)}; unit tests start none"


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


class Classify:
    """A user's own classification task (through ``as_task``), without metric objects."""

    monitor = "val/acc"
    monitor_mode = "max"

    def training_step(self, model, batch):
        from ddpexp.task import Classification

        x, y = batch
        return Classification._metrics_of(model(x), y)


def make_trainer(run_dir, *, samples=(32, 16, 16), batch_size=8, shape=(4,), classes=3,
                 task=None, model=None, callbacks=None, loggers=None, seed=0, lr=0.1, **keys):
    """A one-process Trainer built in this process from real parts: synthetic data of
    ``samples`` (train, val, test; test 0 = none), an MLP, SGD; ``keys`` are trainer keys."""
    import functools

    from ddpexp.config.schema import trainer_config
    from ddpexp.data import Synthetic
    from ddpexp.models import MLP
    from ddpexp.runtime.dist import DistContext, seed_everything
    from ddpexp.training.trainer import Trainer

    data = Synthetic(num_samples=samples[0], val_samples=samples[1], test_samples=samples[2],
                     batch_size=batch_size, shape=list(shape), num_classes=classes)
    keys = {"max_epochs": 1, "progress_bar": False, "strategy": "single",
            "log_every_n_steps": 2, **keys}
    from pathlib import Path

    Path(run_dir).mkdir(parents=True, exist_ok=True)  # the launcher's part
    seed_everything(seed)
    model = model if model is not None else MLP(list(shape), classes, hidden=(8,))
    config = {"seed": seed, "trainer": keys, "data": {"batch_size": batch_size}}
    return Trainer(trainer_config(keys), DistContext(), run_dir, task=task or Classify(),
                   model=model, data=data, datasets=data.load(),
                   optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
                   seed=seed, config=config, callbacks=callbacks, loggers=loggers)


@pytest.fixture
def trainer_factory(tmp_path):
    """``trainer_factory(name="run", **kwargs)``: :func:`make_trainer` in ``tmp_path/name``."""
    def make(name="run", **kwargs):
        return make_trainer(tmp_path / name, **kwargs)

    return make
