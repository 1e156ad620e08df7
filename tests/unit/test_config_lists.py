"""A single value where a list is expected is a list of that one value."""

from __future__ import annotations

from ddpexp.config.lists import as_list
from ddpexp.data import Synthetic
from ddpexp.models import MLP
from ddpexp.task import Classification


def test_one_value_is_a_one_item_list():
    assert as_list("f1") == ["f1"] and as_list(8) == [8] and as_list(None) == []
    assert as_list(["f1", "auroc"]) == ["f1", "auroc"] and as_list((1, 2)) == [1, 2]


def test_the_keys_that_take_a_list_take_one_value():
    assert Classification(metrics="f1", num_classes=3).metric_names == ["f1"]  # not f, 1
    mlp = MLP(input_shape=6, num_classes=3, hidden=8)
    assert [m.out_features for m in mlp.net if hasattr(m, "out_features")] == [8, 3]
    assert Synthetic(shape=6, num_classes=3).shape == (6,)
