"""What an evaluation runs under (eval.apply_overrides): the stored config with the command's
overrides, a built-in strategy decided afresh for the workers asked for now, a user's own
strategy class kept."""

from __future__ import annotations

import pytest

from ddpexp.errors import ConfigError
from ddpexp.eval import apply_overrides

USER = "mypkg.strategies.MyDDP"


def stored(strategy):
    return {"seed": 0, "trainer": {"strategy": strategy, "procs": 2, "gpus": 0, "max_restarts": 3,
                                   "limit_val_batches": 2}}


@pytest.mark.parametrize("strategy, expected", [
    ("ddp", "auto"), ("single", "auto"), ("fsdp", "auto"), ("auto", "auto"),
    (USER, USER), ({"_target_": USER, "bucket": 3}, {"_target_": USER, "bucket": 3}),
])
def test_strategy_decided_afresh_unless_the_users_own(strategy, expected):
    config, split = apply_overrides(stored(strategy), [])
    assert config["trainer"]["strategy"] == expected and split == "test"
    assert config["trainer"]["max_restarts"] == 0 and config["trainer"]["limit_val_batches"] is None


def test_overrides_given_are_kept():
    config, split = apply_overrides(stored("ddp"), ["trainer.strategy=single", "split=val",
                                                    "trainer.limit_val_batches=4"])
    assert (config["trainer"]["strategy"], split) == ("single", "val")
    assert config["trainer"]["limit_val_batches"] == 4


def test_unknown_key_needs_plus():
    with pytest.raises(ConfigError, match=r"trainer\.nope is not a key of the run's config; use "
                                          r"\+trainer\.nope=1"):
        apply_overrides(stored("ddp"), ["trainer.nope=1"])
