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


def test_a_group_option_is_refused_saying_what_an_evaluation_takes():
    for item in ("model=mlp", "debug=fast", "logger=csv"):
        with pytest.raises(ConfigError) as refused:
            apply_overrides(stored("ddp"), [item])
        text = str(refused.value)
        key = item.split("=")[0]
        assert text.startswith(f"{item}: an evaluation rebuilds what its checkpoint was trained "
                               f"with (model, data, task), so it picks no {key} option")
        assert "It takes keys of the run's config (e.g. data.root=DIR" in text
        assert text.endswith("+key=value to add one, and split=test|val")


def test_a_misspelt_key_names_the_closest():
    with pytest.raises(ConfigError, match=r"^trainer.proc is not a key of the run's config; did "
                                          r"you mean trainer.procs\? \(or use \+trainer.proc=1 to add it\)$"):
        apply_overrides(stored("ddp"), ["trainer.proc=1"])


def test_a_key_or_target_added_is_checked_before_any_worker(tmp_path):
    """evaluate() refuses what a worker could not build, before it reads the weights."""
    import torch

    from ddpexp.eval import evaluate

    config = {**stored("ddp"), "model": {"_target_": "ddpexp.models.MLP", "input_shape": [4],
                                         "num_classes": 2}}
    checkpoint = tmp_path / "best.pt"
    torch.save({"config": config, "model": {}}, checkpoint)
    with pytest.raises(ConfigError, match=r"^model.hiden: ddpexp.models.MLP takes no argument "
                                          r"hiden; did you mean model.hidden\?"):
        evaluate(tmp_path, checkpoint, ["+model.hiden=3"])
    with pytest.raises(ConfigError, match=r"^model._target_: cannot import nope.M \(no module"):
        evaluate(tmp_path, checkpoint, ["model._target_=nope.M"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]  # nothing written
