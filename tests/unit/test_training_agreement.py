"""What the ranks of a run decide together (training/agreement.py), in one process and
through a real one-process gloo group."""

from __future__ import annotations

import math
import signal

import pytest
import torch

from ddpexp.training.agreement import STOP_STATUSES, Agreement
from ddpexp.training.divergence import Divergence
from ddpexp.training.meters import RunningMeans


def make(world_size: int = 1, factor=None) -> Agreement:
    return Agreement(0, world_size, torch.device("cpu"), Divergence(factor))


def meter_with(loss: float, n: int = 4) -> RunningMeans:
    m = RunningMeans(torch.device("cpu"))
    m.add({"loss": torch.tensor(loss), "acc": torch.tensor(0.5)}, n)
    return m


def test_request_rejects_unknown_status():
    a = make()
    with pytest.raises(ValueError, match="status 'done' is not one of pruned, early_stopped, stopped"):
        a.request("why", "done")


def test_first_request_stands():
    a = make()
    a.request("first", "stopped")
    a.request("second", "pruned")
    assert a.requested == ("stopped", "first")


def test_alone_agrees_on_own_request():
    a = make()
    assert not a.stopping
    a.request(123, "early_stopped")
    a.alone()
    assert (a.status, a.reason) == ("early_stopped", "123")
    assert a.stopping and not a.interrupted


def test_alone_without_request_changes_nothing():
    a = make()
    a.alone()
    assert a.status is None and a.reason is None and not a.stopping


def test_alone_acts_on_signal():
    a = make()
    a.signal.signum = signal.SIGTERM  # what its handler records
    a.alone()
    assert a.interrupted and a.stopping


def test_reduce_returns_sums_of_values_in_one_process():
    a = make()
    sums = a.reduce((torch.tensor([1.0, 2.0]), 3.0), meter_with(0.5), step=1, epoch=0)
    assert sums == [1.0, 2.0, 3.0]
    assert not a.divergence and a.status is None


def test_reduce_before_any_meter_add():
    a = make()
    sums = a.reduce((5.0,), RunningMeans(torch.device("cpu")), step=0, epoch=0)
    assert sums == [5.0]
    assert not a.divergence


def test_reduce_notes_nonfinite_loss():
    a = make()
    a.reduce((), meter_with(float("nan")), step=7, epoch=2)
    assert a.divergence.at["step"] == 7 and a.divergence.at["epoch"] == 2
    assert math.isnan(a.divergence.at["loss"])


def test_reduce_notes_loss_past_ceiling():
    a = make(factor=10.0)
    a.divergence.ceiling.set_start(2.0)
    a.reduce((), meter_with(21.0, n=2), step=3, epoch=0)  # loss sum 42 over 2 samples: 21 > 20
    assert a.divergence.at == {"step": 3, "epoch": 0, "loss": 21.0}


def test_reduce_carries_signal():
    a = make()
    a.signal.signum = signal.SIGINT
    a.reduce((), meter_with(0.1), step=1, epoch=0)
    assert a.interrupted and a.status is None


def test_reduce_through_real_group_sums_and_stops(gloo_group):
    import torch.distributed as dist

    assert dist.get_world_size() == 1
    a = make()
    a.request("enough", "pruned")
    sums = a.reduce((torch.tensor([4.0]),), meter_with(0.2), step=2, epoch=1)
    assert sums == [4.0]
    assert a.status == "pruned" and a.reason == "enough"


def test_stop_statuses_order():
    assert STOP_STATUSES == ("pruned", "early_stopped", "stopped")
