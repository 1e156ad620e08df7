"""Config entries that name a class to build (config/components.py)."""

from __future__ import annotations

import pytest

from ddpexp.callbacks import Callback, EarlyStopping
from ddpexp.config import components
from ddpexp.errors import ConfigError


def test_locate():
    node = {"_target_": "ddpexp.callbacks.EarlyStopping", "patience": 2}
    assert components.locate("callbacks", "es", node, Callback) is EarlyStopping


def test_locate_needs_target():
    with pytest.raises(ConfigError, match=r"callbacks.probe has no _target_: name the class to "
                                          r"build, e.g. \+callbacks.probe._target_=mypackage.MyCallback, "
                                          r"or remove the entry with ~callbacks.probe"):
        components.locate("callbacks", "probe", {"k": 3}, Callback)


def test_locate_unimportable():
    with pytest.raises(ConfigError, match=r"callbacks.p._target_=nope.Probe does not import \(.*\); "
                                          r"check the dotted path"):
        components.locate("callbacks", "p", {"_target_": "nope.Probe"}, Callback)


def test_locate_wrong_base():
    with pytest.raises(ConfigError, match="callbacks.p._target_=collections.OrderedDict is not a "
                                          "subclass of ddpexp.Callback"):
        components.locate("callbacks", "p", {"_target_": "collections.OrderedDict"}, Callback)


def test_check_skips_removed_and_refuses_non_dict():
    components.check("callbacks", {"ema": None}, Callback)
    components.check("callbacks", None, Callback)
    with pytest.raises(ConfigError, match="callbacks must be a dict of entries by name, got list"):
        components.check("callbacks", [1], Callback)


def test_build():
    built = components.build("callbacks", {
        "es": {"_target_": "ddpexp.callbacks.EarlyStopping", "patience": 4}, "gone": None}, Callback)
    assert list(built) == ["es"] and isinstance(built["es"], EarlyStopping)


def test_build_reports_constructor_error():
    with pytest.raises(ConfigError, match=r"callbacks.es \(ddpexp.callbacks.EarlyStopping\) could not "
                                          r"be built: TypeError: .*nonsense"):
        components.build("callbacks", {"es": {"_target_": "ddpexp.callbacks.EarlyStopping",
                                              "nonsense": 1}}, Callback)


def test_build_keeps_ddpexp_error_message():
    with pytest.raises(ConfigError, match=r"callbacks.checkpoint: callbacks.checkpoint.save_top_k=0 "
                                          r"must be >= 1"):
        components.build("callbacks", {"checkpoint": {"_target_": "ddpexp.callbacks.ModelCheckpoint",
                                                      "save_top_k": 0}}, Callback)
