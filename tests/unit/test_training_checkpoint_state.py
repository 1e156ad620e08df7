"""What a checkpoint holds, gathered from a trainer built in this process and given back
to one (training/checkpoint_state.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from ddpexp.callbacks import EarlyStopping, ModelCheckpoint
from ddpexp.errors import ConfigError
from ddpexp.models import MLP
from ddpexp.training import checkpoint_state as state


def callbacks():
    return {"checkpoint": ModelCheckpoint(), "early_stopping": EarlyStopping(patience=5)}


@pytest.fixture
def fitted(trainer_factory):
    """A trainer fitted for two epochs, its last.pt written."""
    t = trainer_factory("first", callbacks=callbacks(), max_epochs=2)
    t.fit()
    return t


def test_gather_schema_before_training(trainer_factory, tmp_path):
    t = trainer_factory()
    s = state.gather(t)
    assert s["format"] == state.FORMAT == 3
    assert set(s) == {"format", "model", "optimizer", "scheduler", "scaler", "epoch", "batch",
                      "step", "best", "metrics", "history", "callbacks", "loggers", "logger_queues", "ranks",
                      "world_size", "layout", "global_batch", "data", "config"}
    assert (s["epoch"], s["batch"], s["step"], s["world_size"], s["global_batch"]) == (0, 0, 0, 1, 8)
    assert s["data"] == {"epoch": 0, "samples": 0, "seed": t.seed,
                         "split_samples": len(t.train_sampler.dataset)}
    assert s["layout"] == {"strategy": "single", "dp": 1, "tp": 1}
    assert s["best"] == {"metric": "val/acc", "value": None, "epoch": None}
    assert s["scheduler"] is None and s["scaler"] is None
    assert list(s["model"]) == list(t.module.state_dict())
    assert len(s["ranks"]) == 1 and set(s["ranks"][0]) == {"rng", "train_accum"}
    torch.save(s, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True)["step"] == 0


def test_last_checkpoint_of_a_fit(fitted):
    s = torch.load(fitted.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (s["epoch"], s["batch"], s["step"]) == (2, 0, 8)
    assert [h["epoch"] for h in s["history"]] == [0, 1]
    assert [h["step"] for h in s["history"]] == [4, 8]
    assert s["metrics"] == {k: v for k, v in s["history"][-1].items() if k.startswith("val/")}
    best = max(s["history"], key=lambda h: h["val/acc"])
    assert s["best"]["value"] == best["val/acc"]
    assert set(s["callbacks"]) == {"checkpoint", "early_stopping"}
    for k, v in fitted.module.state_dict().items():
        assert torch.equal(s["model"][k], v), k


def test_load_resumes_weights_optimizer_counters(fitted, trainer_factory):
    path = fitted.run_dir / "checkpoints" / "last.pt"
    saved = torch.load(path, weights_only=True)
    fresh = trainer_factory("second", callbacks=callbacks(), max_epochs=3, seed=1)
    state.load(fresh, path)
    assert (fresh.epoch, fresh.step) == (2, 8)
    assert fresh.state.history == saved["history"] and fresh.state.metrics == saved["metrics"]
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(saved["model"][k], v), k
    buf = fresh.optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, saved["optimizer"]["state"][0]["momentum_buffer"])
    again = state.gather(fresh)
    assert again["best"] == saved["best"]
    assert again["callbacks"] == saved["callbacks"]


def test_load_restores_random_state(fitted, trainer_factory):
    path = fitted.run_dir / "checkpoints" / "last.pt"
    saved = torch.load(path, weights_only=True)
    fresh = trainer_factory("second", callbacks=callbacks(), max_epochs=3)
    state.load(fresh, path)
    assert torch.equal(torch.get_rng_state(), saved["ranks"][0]["rng"]["torch"])


def test_resume_continues_to_more_epochs(fitted, trainer_factory):
    fresh = trainer_factory("second", callbacks=callbacks(), max_epochs=3)
    result = fresh.fit(resume_from=fitted.run_dir / "checkpoints" / "last.pt")
    assert result["status"] == "completed"
    assert (result["epochs"], result["steps"]) == (3, 12)
    assert [h["epoch"] for h in result["history"]] == [0, 1, 2]


def test_load_refuses_another_model(fitted, trainer_factory):
    other = trainer_factory("other", model=MLP([4], 3, hidden=(5,)))
    with pytest.raises(ConfigError, match=r"does not fit this run's model: shapes differ: "
                                          r"net.1.weight \[8, 4\] in the checkpoint vs \[5, 4\] here"):
        state.load(other, fitted.run_dir / "checkpoints" / "last.pt")


def test_load_refuses_weights_only_file(fitted, trainer_factory, tmp_path):
    s = torch.load(fitted.run_dir / "checkpoints" / "last.pt", weights_only=True)
    del s["optimizer"]
    torch.save(s, tmp_path / "weights.pt")
    with pytest.raises(ConfigError, match=r"holds the weights only .*resume from its run's "
                                          r"checkpoints/last.pt, or evaluate it with python -m ddpexp.eval"):
        state.load(trainer_factory("x"), tmp_path / "weights.pt")


def test_load_refuses_broken_optimizer_state(fitted, trainer_factory, tmp_path):
    s = torch.load(fitted.run_dir / "checkpoints" / "last.pt", weights_only=True)
    s["optimizer"]["param_groups"] = []
    torch.save(s, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="does not fit this run's model/optimizer"):
        state.load(trainer_factory("x"), tmp_path / "bad.pt")


def test_restore_other_world_size_warns(fitted, trainer_factory, caplog):
    s = torch.load(fitted.run_dir / "checkpoints" / "last.pt", weights_only=True)
    s["world_size"], s["ranks"] = 2, s["ranks"] * 2
    s["global_batch"] = 16
    t = trainer_factory("x", callbacks=callbacks())
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        state.restore(t, s)
    assert "checkpoint written by 2 workers, resumed on 1: random streams start afresh" in caplog.text


def test_restore_raw_model_continues_trained_weights(fitted, trainer_factory, caplog):
    s = torch.load(fitted.run_dir / "checkpoints" / "last.pt", weights_only=True)
    raw = {k: v + 1 for k, v in s["model"].items()}
    s["raw_model"], s["ema"] = raw, {"decay": 0.9, "updates": 8}
    t = trainer_factory("x", callbacks=callbacks())
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        state.restore(t, s)
    assert "holds an average of the weights (trainer.ema_decay=0.9)" in caplog.text
    assert torch.equal(t.module.state_dict()["net.1.weight"], raw["net.1.weight"])


def test_restore_names_missing_and_extra_callback_states(fitted, trainer_factory, caplog):
    s = torch.load(fitted.run_dir / "checkpoints" / "last.pt", weights_only=True)
    s["callbacks"] = {"early_stopping": s["callbacks"]["early_stopping"], "mine": {}}
    t = trainer_factory("x", callbacks=callbacks())
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        state.restore(t, s)
    assert "callbacks.checkpoint has no state in the checkpoint: it starts afresh" in caplog.text
    assert "the checkpoint holds the state of callbacks mine, which this run does not have" in caplog.text


def test_callback_states_of_format_2():
    old = {"top_k": [[0.5, 1, "f.pt"]], "best": {"value": 0.7}, "early_stop": 2}
    assert state.callback_states(old) == {
        "checkpoint": {"top_k": [[0.5, 1, "f.pt"]]},
        "early_stopping": {"best": 0.7, "bad_epochs": 2}}
    assert state.callback_states({"callbacks": None}) == {}


@pytest.mark.parametrize("saved, batch, here, expected", [
    (16, 3, 8, 6),     # twice the micro-batches at half the global batch
    (8, 3, 8, 3),      # the same global batch
    (8, 3, 16, 1),     # 24 samples in: the micro-batch before
    (8, 0, 16, 0),     # at the epoch's start
    (None, 4, 8, 4),   # no global batch saved, no config: as saved
])
def test_batch_here(saved, batch, here, expected):
    s = {"batch": batch, "epoch": 1, "global_batch": saved}
    assert state._batch_here(s, here, is_main=False) == expected


def test_batch_here_from_config_of_old_checkpoint(caplog):
    s = {"batch": 5, "epoch": 0, "config": {"data": {"batch_size": 4}}, "world_size": 2}
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        assert state._batch_here(s, 16, is_main=True) == 2
    assert "the checkpoint is 40 samples into epoch 0, not a whole number" in caplog.text


def test_model_difference():
    mine = {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)}
    saved = {"a": torch.zeros(2), "b": torch.zeros(4), "x": torch.zeros(1)}
    assert state.model_difference(mine, saved) == (
        "the checkpoint lacks c; the model has no x; "
        "shapes differ: b [4] in the checkpoint vs [3] here")
    assert state.model_difference(mine, dict(mine)) == ""


def test_model_difference_shows_a_few():
    mine = {f"k{i}": torch.zeros(1) for i in range(7)}
    assert state.model_difference(mine, {}, show=2) == "the checkpoint lacks k0, k1 and 5 more"


def test_schedule_progress_drops_lambdas():
    s = {"last_epoch": 4, "lr_lambdas": [{"x": 1}, None]}
    assert state._schedule_progress(s, None) == {"last_epoch": 4, "lr_lambdas": [None, None]}
    plain = {"last_epoch": 2}
    assert state._schedule_progress(plain, None) == plain


def test_a_restart_refuses_a_changed_shard_of_the_runs_own_checkpoint(trainer_factory, gloo_group):
    import dataclasses

    from ddpexp.checkpoint import files as ckpt_files
    from ddpexp.checkpoint import sharded as ckpt_sharded
    from ddpexp.errors import CheckpointError

    first = trainer_factory("run", strategy="fsdp", callbacks={"checkpoint": ModelCheckpoint()})
    first.fit()
    last = first.run_dir / "checkpoints" / ckpt_files.LAST
    assert ckpt_sharded.is_sharded(last)

    def restarted():
        t = trainer_factory("run", strategy="fsdp", callbacks={"checkpoint": ModelCheckpoint()})
        t.ctx = dataclasses.replace(t.ctx, restart=1)  # as the workers' first restart sees it
        return t

    t = restarted()
    state.load(t, last)
    assert t.step == first.step > 0
    shard = next(p for p in last.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checkpoint {shard} changed since it was saved"):
        state.load(restarted(), last)


SMALL = ["data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=32",
         "data.val_samples=16", "data.batch_size=8", "model=mlp", "model.hidden=[8]",
         "trainer.test=false", "trainer.max_epochs=2"]


@pytest.mark.parametrize("schedule", ["scheduler=cosine", "scheduler=onecycle", "scheduler=none"])
def test_a_changed_lr_continues_the_schedule_at_its_step_with_the_new_value(tmp_path, schedule):
    from helpers import build_trainer

    from ddpexp.config import resume as rules

    first = build_trainer(tmp_path / "first", [*SMALL, schedule, "trainer.max_steps=3"])
    first.fit()
    saved = torch.load(first.run_dir / "checkpoints" / "last.pt", weights_only=True)
    t = build_trainer(tmp_path / "resumed", [*SMALL, schedule, "optimizer.lr=0.5"])
    found = rules.changes(saved["config"], t.config)
    assert "optimizer.lr" in [c.key for c in found]
    applied = state.restore(t, saved, [{"key": c.key, "from": c.before, "to": c.after} for c in found])
    assert {"key": "optimizer.lr", "from": 0.05, "to": 0.5, "step": 3} in applied
    # A run started with lr 0.5 has, after the same 3 steps, the same lr, momentum and bounds.
    ref = build_trainer(tmp_path / "ref", [*SMALL, schedule, "optimizer.lr=0.5"])
    for _ in range(3):
        ref.optimizer.step()
        if ref.scheduler is not None:
            ref.scheduler.step()
    (got,), (want,) = t.optimizer.param_groups, ref.optimizer.param_groups
    for key in ("lr", "momentum", "initial_lr", "max_lr", "min_lr"):
        assert got.get(key) == pytest.approx(want.get(key)), key
    if ref.scheduler is not None:
        assert t.scheduler.base_lrs == pytest.approx(ref.scheduler.base_lrs)
        assert t.scheduler.get_last_lr() == pytest.approx(ref.scheduler.get_last_lr())
    # The checkpoint's own optimizer state (momentum buffers) is kept.
    assert len(t.optimizer.state) == len(saved["optimizer"]["state"]) > 0
