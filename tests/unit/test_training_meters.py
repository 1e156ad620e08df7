"""Per-sample means of a task's metrics (training/meters.py)."""

from __future__ import annotations

import pytest
import torch

from ddpexp.errors import ConfigError
from ddpexp.training.meters import OUTPUTS, RunningMeans, means, metric_names

CPU = torch.device("cpu")


def test_metric_names_keeps_order_and_drops_outputs():
    out = {"loss": torch.tensor(1.0), OUTPUTS: torch.zeros(3, 2), "acc": torch.tensor(0.5)}
    assert metric_names(out, "T", "training_step") == ["loss", "acc"]


def test_metric_names_needs_loss():
    with pytest.raises(ConfigError, match=r"task T: training_step must return a dict of scalar "
                                          r"tensors with a 'loss' entry; got \['acc'\]"):
        metric_names({"acc": torch.tensor(1.0)}, "T", "training_step")


def test_metric_names_refuses_non_dict():
    with pytest.raises(ConfigError, match="got Tensor"):
        metric_names(torch.tensor(1.0), "T", "validation_step")


def test_metric_names_refuses_non_scalars():
    out = {"loss": torch.tensor(1.0), "per_sample": torch.ones(4), "n": 3}
    with pytest.raises(ConfigError, match="returned non-scalar values for per_sample, n; each entry"):
        metric_names(out, "T", "training_step")


def test_running_means_weights_by_samples():
    m = RunningMeans(CPU)
    m.add({"loss": torch.tensor(1.0), "acc": torch.tensor(0.0)}, 3)
    m.add({"loss": torch.tensor(3.0), "acc": torch.tensor(1.0)}, 1)
    assert m.names == ["loss", "acc"] and m.seen == 4
    assert m.pending().tolist() == [6.0, 1.0]
    assert m.pending().dtype == torch.float64
    assert m.value("loss") == 6.0 and m.value("nope") is None


def test_running_means_first_add_checks_names():
    with pytest.raises(ConfigError, match="'loss' entry"):
        RunningMeans(CPU).add({"acc": torch.tensor(1.0)}, 2, "MyTask", "training_step")


def test_pending_before_add_is_empty():
    m = RunningMeans(CPU)
    assert m.pending().shape == (0,) and m.value("loss") is None
    assert m.state_dict() == {"names": [], "sums": [], "seen": 0}


def test_reset_keeps_names():
    m = RunningMeans(CPU, names=["loss"])
    m.add({"loss": torch.tensor(2.0)}, 5)
    m.reset()
    assert m.names == ["loss"] and m.seen == 0 and m.pending().tolist() == [0.0]


def test_state_dict_round_trip():
    m = RunningMeans(CPU)
    m.add({"loss": torch.tensor(0.25), "acc": torch.tensor(0.75)}, 4)
    state = m.state_dict()
    assert state == {"names": ["loss", "acc"], "sums": [1.0, 3.0], "seen": 4}
    other = RunningMeans(CPU)
    other.load_state_dict(state)
    assert other.names == ["loss", "acc"] and other.seen == 4
    assert other.pending().tolist() == [1.0, 3.0]
    other.add({"loss": torch.tensor(1.0), "acc": torch.tensor(1.0)}, 1)
    assert other.pending().tolist() == [2.0, 4.0]


def test_load_empty_state_keeps_none():
    m = RunningMeans(CPU)
    m.load_state_dict({"names": [], "sums": [], "seen": 0})
    assert m.names is None and m.sums is None


def test_means_divides_and_prefixes():
    assert means(["loss", "acc"], [6.0, 3.0], 4, "val") == {"val/loss": 1.5, "val/acc": 0.75}


def test_means_of_nothing_is_sum():
    assert means(["loss"], [0.0], 0, "val") == {"val/loss": 0.0}


def test_means_adds_derived():
    got = means(["mse"], [8.0], 2, "test", derived=lambda v: {"rmse": v["mse"] ** 0.5})
    assert got == {"test/mse": 4.0, "test/rmse": 2.0}
