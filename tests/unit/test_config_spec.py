"""The run's spec (config/spec.py): built once by the parent from the composed config, the
one thing the workers get, the same after pickle and JSON; and the builders on its way leave
the config they are given as it was."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
from omegaconf import open_dict

from ddpexp.config.compose import composed
from ddpexp.config.schema import MonitorMode, TrainerConfig, to_plain
from ddpexp.config.spec import Plan, RunSpec
from ddpexp.errors import ConfigError
from ddpexp.launch.fanout import plan_run


def _plain(*overrides: str) -> dict:
    """The resolved config of ``overrides`` as a run's parent has it (no ``hydra`` node)."""
    cfg = composed(list(overrides))
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return to_plain(cfg)


def _spec(tmp_path, *overrides: str, **rest) -> RunSpec:
    cfg = composed(list(overrides))
    plan = plan_run(cfg.trainer, visible_gpus=0)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return RunSpec.build(to_plain(cfg), plan, run_dir=tmp_path, log_file=tmp_path / "ddpexp.log",
                         **rest)


def test_built_from_the_composed_config(tmp_path):
    spec = _spec(tmp_path, "trainer.procs=2", "trainer.max_epochs=3", "model=mlp",
                 hparams={"trainer.procs": 2})
    assert spec.plan == Plan("ddp", 2, 1, 0) and spec.plan.world_size == 2
    # The layout decided by the parent, in both forms: strings in the plain config, enums in
    # the typed one.
    assert spec.config["trainer"]["strategy"] == "ddp" and spec.config["trainer"]["procs"] == 2
    assert isinstance(spec.trainer, TrainerConfig)
    assert spec.trainer.strategy == "ddp" and spec.trainer.procs == 2
    assert spec.trainer.max_epochs == 3 == spec.config["trainer"]["max_epochs"]
    # The task's monitor, filled in once for every reader.
    assert spec.config["trainer"]["monitor"] == "val/acc" == spec.trainer.monitor
    assert spec.config["trainer"]["monitor_mode"] == "max"
    assert spec.trainer.monitor_mode is MonitorMode.max
    assert spec.config["model"]["_target_"] == "ddpexp.models.MLP"
    assert spec.run_dir == tmp_path and spec.log_file == tmp_path / "ddpexp.log"
    assert spec.hparams == {"trainer.procs": 2} and spec.resume_from is None


def test_build_leaves_the_given_config_unchanged(tmp_path):
    plain = _plain("trainer.procs=2")
    before = copy.deepcopy(plain)
    RunSpec.build(plain, Plan("ddp", 2, 1, 0), run_dir=tmp_path, log_file=tmp_path / "x.log")
    assert plain == before and plain["trainer"]["monitor"] is None


@pytest.mark.parametrize("spec_of", [
    lambda s: pickle.loads(pickle.dumps(s)),
    lambda s: RunSpec.from_json(s.to_json()),
    lambda s: RunSpec.from_json(s.to_json().encode()),  # as a TCPStore returns it
], ids=["pickle", "json", "json-bytes"])
def test_round_trips(tmp_path, spec_of):
    from ddpexp.modes.evaluate import Evaluate
    from ddpexp.modes.train import Train

    spec = _spec(tmp_path, "trainer.procs=2", "trainer.fsdp.wrap=[Linear]",
                 resume_from=tmp_path / "checkpoints" / "last.pt",
                 hparams={"optimizer.lr": 0.1})
    back = spec_of(spec)
    assert back == spec and back.mode == Train()
    assert back.trainer.strategy == "ddp" and back.trainer.fsdp.wrap == ["Linear"]
    assert back.resume_from == tmp_path / "checkpoints" / "last.pt"
    # The mode travels typed, its paths as paths.
    evaluate = _spec(tmp_path, mode=Evaluate(tmp_path / "best.pt", "val"))
    assert spec_of(evaluate).mode == Evaluate(tmp_path / "best.pt", "val")


def test_a_mode_is_its_module_and_one_registry_line():
    from ddpexp.config.modes import MODES, from_dict, mode_class, to_dict
    from ddpexp.modes.evaluate import Evaluate

    assert set(MODES) == {"train", "evaluate", "find_lr", "find_batch"}
    assert all(mode_class(name).name == name for name in MODES)
    assert to_dict(Evaluate(Path("/r/best.pt"))) == {"name": "evaluate",
                                                     "checkpoint": "/r/best.pt", "split": "test"}
    assert from_dict(to_dict(Evaluate(Path("/r/best.pt")))) == Evaluate(Path("/r/best.pt"))
    with pytest.raises(ValueError, match="run mode 'find' is not one of"):
        mode_class("find")


def test_a_trainer_key_the_schema_refuses_is_a_config_error(tmp_path):
    plain = _plain()
    plain["trainer"]["gpu"] = 4
    with pytest.raises(ConfigError, match="gpu"):
        RunSpec.build(plain, Plan("single", 1, 1, 0), run_dir=tmp_path, log_file=tmp_path / "x.log")


def test_build_parts_returns_the_data_keys_and_leaves_its_argument(tmp_path):
    from ddpexp.runtime.dist import DistContext
    from ddpexp.training.build import build_parts

    text = tmp_path / "input.txt"
    text.write_text("abcab " * 200)
    spec = _spec(tmp_path, "experiment=char_gpt", f"data.path={text}", "~logger",
                 "model.n_layer=1", "model.n_embd=8", "model.n_head=1")
    before = copy.deepcopy(spec.config)
    assert before["model"]["vocab_size"] is None and before["data"]["num_classes"] is None
    parts = build_parts(spec.config, spec.trainer, DistContext())
    assert spec.config == before
    assert parts["cfg"] is spec.trainer
    assert parts["config"]["data"]["num_classes"] == 4  # a, b, c and the space
    assert parts["config"]["model"]["vocab_size"] == 4
