"""Callback state with numpy arrays and scalars survives a checkpoint that a plain
``torch.load(weights_only=True)`` reads; what cannot is refused, naming the key."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from ddpexp.checkpoint import portable
from ddpexp.errors import ConfigError


def _through_a_file(value, tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"callbacks": {"probe": portable.encode(value, "callbacks.probe")}}, path)
    return portable.decode(torch.load(path, weights_only=True)["callbacks"]["probe"])


def test_numpy_arrays_and_scalars_round_trip_through_a_safe_load(tmp_path):
    state = {
        "floats": np.arange(6, dtype=np.float32).reshape(2, 3),
        "big_endian": np.array([1, 2, 3], dtype=">i4"),
        "unsigned": np.array([1, 2**40], dtype=np.uint64),
        "mask": np.array([True, False]),
        "strided": np.arange(10.0)[::3],
        "words": np.array(["ab", "cde"]),
        "when": np.array(["2024-01-02"], dtype="datetime64[D]"),
        "count": np.int64(7), "best": np.float64(0.25), "flag": np.bool_(True),
        "history": [np.float32(1.5), (np.int8(-3), "x")],
        "plain": OrderedDict(a=1, b=[1.0, None], c={(1, 2): b"raw"}, d={3, 4}),
        "tensor": torch.ones(2),
    }
    back = _through_a_file(state, tmp_path)
    assert back.keys() == state.keys()
    for key in ("floats", "big_endian", "unsigned", "mask", "strided", "words", "when"):
        assert type(back[key]) is np.ndarray and back[key].dtype == state[key].dtype, key
        assert np.array_equal(back[key], state[key]), key
        assert back[key].flags.writeable, key
    for key in ("count", "best", "flag"):
        assert type(back[key]) is type(state[key]) and back[key] == state[key], key
    assert type(back["history"][0]) is np.float32 and back["history"][1][0] == np.int8(-3)
    assert type(back["history"][1]) is tuple and back["plain"] == state["plain"]
    assert type(back["plain"]) is OrderedDict and torch.equal(back["tensor"], state["tensor"])


class Opaque:
    pass


@pytest.mark.parametrize("state, key, what", [
    ({"seen": [1, {"obj": Opaque()}]}, "state_dict()['seen'][1]['obj']",
     "a test_checkpoint_portable.Opaque"),
    ({"arr": np.array([object()])}, "state_dict()['arr']", "numpy array of dtype object"),
    ({np.int64(3): 1}, "state_dict()", "convert it, e.g. int(k)"),
    ({"f": frozenset([1])}, "state_dict()['f']", "a frozenset"),
    (lambda: 0, "state_dict()", "a function"),
])
def test_what_a_safe_load_cannot_read_is_refused_with_its_key(state, key, what):
    with pytest.raises(ConfigError, match="callbacks.probe: ") as err:
        portable.encode(state, "callbacks.probe")
    text = str(err.value)
    assert f"callbacks.probe: {key} holds" in text and what in text
    assert "weights_only=True" in text
