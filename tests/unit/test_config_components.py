"""Config entries that name a class to build (config/components.py)."""

from __future__ import annotations

import collections
from pathlib import Path

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


def test_a_target_that_does_not_import_is_named_with_its_key():
    for target, why in (("nope.Model", "no module named 'nope'"),
                        ("ddpexp.models.MLPP", "ddpexp.models has no MLPP; did you mean ddpexp.models.MLP?"),
                        ("ddpexp.qqq.X", "ddpexp has no qqq")):
        with pytest.raises(ConfigError) as refused:
            components.check_nodes({"model": {"_target_": target}})
        assert str(refused.value) == (f"model._target_: cannot import {target} ({why}); check the "
                                      "dotted path and that its package is installed")


def test_a_key_the_target_takes_no_argument_for_names_the_closest():
    model = {"_target_": "ddpexp.models.MLP", "input_shape": [4], "num_classes": 2}
    with pytest.raises(ConfigError, match=r"^model.hiden: ddpexp.models.MLP takes no argument hiden; "
                                          r"did you mean model.hidden\? \(ddpexp.models.MLP takes: "
                                          r"input_shape, num_classes, hidden, dropout\)$"):
        components.check_nodes({"model": {**model, "hiden": [64]}})
    # The arguments of a DataSource subclass include its base's (handed on by **kwargs).
    with pytest.raises(ConfigError, match=r"data.batch_sise: .* did you mean data.batch_size\?"):
        components.check_nodes({"data": {"_target_": "ddpexp.data.Digits", "batch_sise": 8}})
    # An argument the target needs and the config leaves out.
    with pytest.raises(ConfigError, match=r"^model: ddpexp.models.MLP needs num_classes; add "
                                          r"\+model.num_classes=\.\.\.$"):
        components.check_nodes({"model": {"_target_": "ddpexp.models.MLP", "input_shape": [4]}})
    # A partial target's leading arguments are ddpexp's to pass.
    with pytest.raises(ConfigError, match=r"optimizer.params: ddpexp passes params to torch.optim.SGD"):
        components.check_nodes({"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True,
                                              "params": []}})
    # A key of a node that builds nothing would never be read.
    with pytest.raises(ConfigError, match=r"^scheduler.gamma: the scheduler config builds nothing "
                                          r"\(no _target_, as scheduler=none\), so gamma would "
                                          r"never be read; choose a scheduler first"):
        components.check_nodes({"scheduler": {"gamma": 0.5}})
    components.check_nodes({"model": {**model, "hidden": [8]},
                            "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
                            "scheduler": {}})


def test_kwargs_that_go_elsewhere_take_anything(monkeypatch):
    # faulty.Faulty hands its **kwargs to an MLP it builds, not to nn.Module.
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "plugins"))
    components.check_nodes({"model": {"_target_": "faulty.Faulty", "input_shape": [4],
                                      "num_classes": 2, "hidden": [8], "rank": 0}})
    assert components.arguments(collections.namedtuple("P", "a"))[2]  # built by __new__


def test_every_shipped_option_passes_the_check():
    from omegaconf import OmegaConf

    conf = Path(components.__file__).parents[1] / "conf"
    for group in components.BUILT_NODES:
        for path in sorted((conf / group).glob("*.yaml")):
            components.check_nodes({group: OmegaConf.load(path)})  # its keys, as they are
