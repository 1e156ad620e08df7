"""Which metric a run is judged by (config/monitor.py) and the schema's typed trainer node
(config/schema.py)."""

from __future__ import annotations

import pytest

from ddpexp.config import monitor, schema
from ddpexp.errors import ConfigError


@pytest.mark.parametrize("name, mode", [
    ("val/acc", "max"), ("val/F1", "max"), ("val/auroc", "max"), ("val/r2", "max"),
    ("val/loss", "min"), ("val/mse", "min"), ("val/ppl", "min"), ("top1_acc", "max"),
])
def test_guess_mode(name, mode):
    assert monitor.guess_mode(name) == mode


def test_task_defaults():
    assert monitor.task_defaults("ddpexp.task.Classification") == ("val/acc", "max")
    assert monitor.task_defaults("ddpexp.task.Task") == ("val/loss", "min")
    with pytest.raises(ConfigError, match="task._target_=ddpexp.task.Nope cannot be imported"):
        monitor.task_defaults("ddpexp.task.Nope")


def test_resolve_from_task_defaults():
    assert monitor.resolve_monitor("ddpexp.task.Classification") == ("val/acc", "max")
    assert monitor.resolve_monitor("ddpexp.task.Regression") == ("val/mse", "min")
    assert monitor.resolve_monitor("ddpexp.task.LanguageModel") == ("val/loss", "min")


def test_resolve_given_monitor():
    assert monitor.resolve_monitor("ddpexp.task.Classification", "val/loss") == ("val/loss", "min")
    assert monitor.resolve_monitor("ddpexp.task.Classification", "val/acc") == ("val/acc", "max")
    assert monitor.resolve_monitor("no.such.Task", "val/x", "max") == ("val/x", "max")
    assert monitor.resolve_monitor("ddpexp.task.Regression", None, "max") == ("val/mse", "max")


def test_resolve_unimportable_task():
    with pytest.raises(ConfigError, match="task._target_=no.such.Task cannot be imported"):
        monitor.resolve_monitor("no.such.Task")


def test_with_monitor_fills_a_copy():
    config = {"task": {"_target_": "ddpexp.task.Classification"},
              "trainer": {"monitor": None, "monitor_mode": None}}
    filled = monitor.with_monitor(config)
    assert filled["trainer"] == {"monitor": "val/acc", "monitor_mode": "max"}
    assert config["trainer"] == {"monitor": None, "monitor_mode": None}


def test_trainer_config_typed():
    t = schema.trainer_config({"strategy": "ddp", "monitor_mode": "min", "max_epochs": 3})
    assert t.strategy == "ddp" and t.monitor_mode is schema.MonitorMode.min
    assert t.max_epochs == 3 and t.gpus == 0 and t.fsdp.wrap is None


def test_trainer_config_refuses_typos_and_bad_enums():
    from omegaconf.errors import ConfigKeyError, ValidationError

    with pytest.raises(ConfigKeyError, match="gpu"):
        schema.trainer_config({"gpu": 4})
    with pytest.raises(ValidationError, match="min"):
        schema.trainer_config({"monitor_mode": "minimum"})


def test_composed_config_is_plain_and_typed():
    from helpers import compose_config

    plain = compose_config("trainer.max_epochs=2", "model=mlp")
    assert plain["trainer"]["strategy"] == "single" and plain["trainer"]["max_epochs"] == 2
    assert plain["model"]["_target_"] == "ddpexp.models.MLP"
    assert plain["model"]["input_shape"] == plain["data"]["shape"] == [1, 8, 8]
    assert plain["trainer"]["monitor"] == "val/acc"
