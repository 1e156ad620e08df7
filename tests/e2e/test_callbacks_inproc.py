"""Callbacks run in this process: the order events fire in, callbacks by their order, a
default one removed, a bad entry refused before any worker starts, state that survives a resume
and state without its callback."""

from __future__ import annotations

import pytest
import torch
from helpers import build_trainer, run_cli_here

import ddpexp
from ddpexp.callbacks import Callback, Dispatch

ARGS = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "trainer.log_every_n_steps=2",
]


def test_early_stopping_counter_survives_a_resume(tmp_path):
    """With lr=0 nothing improves after epoch 0: patience 3 stops after epoch 3. A run
    stopped after epoch 1 and resumed must stop there too (a counter restarted at the resume
    would run two epochs longer)."""
    args = [*ARGS, "optimizer.lr=0", "trainer.early_stop_patience=3", "trainer.test=false"]
    whole = build_trainer(tmp_path / "whole", [*args, "trainer.max_epochs=10"]).fit()
    assert whole["status"] == "early_stopped" and whole["epochs"] == 4
    first = build_trainer(tmp_path / "part", [*args, "trainer.max_epochs=2"]).fit()
    assert first["status"] == "completed"
    last = tmp_path / "part/checkpoints/last.pt"
    assert torch.load(last, weights_only=True)["callbacks"]["early_stopping"]["bad_epochs"] == 1
    resumed = build_trainer(tmp_path / "part", [*args, "trainer.max_epochs=10"]).fit(resume_from=last)
    assert (resumed["status"], resumed["epochs"]) == ("early_stopped", 4)


def test_removing_a_default_callback(tmp_path):
    with_ema = build_trainer(tmp_path / "a", [*ARGS, "trainer.ema_decay=0.9"])
    without = build_trainer(tmp_path / "b", [*ARGS, "trainer.ema_decay=0.9", "~callbacks.ema"])
    assert "ema" in dict(with_ema.callbacks) and "ema" not in dict(without.callbacks)
    without.fit()
    assert "raw_model" not in torch.load(tmp_path / "b/checkpoints/best.pt", weights_only=True)
    # A callback whose key is null is left out of the run altogether: nothing fires for it.
    names = dict(build_trainer(tmp_path / "c", ARGS).callbacks)
    assert {"checkpoint", "lr_monitor"} <= set(names) and not {"ema", "early_stopping"} & set(names)


def _recording(event: str):
    def method(self, trainer, *args):
        self.log.append((self.name, event, trainer.epoch, trainer.step))
    return method


class Recorder(Callback):
    """Records every event it sees, with the trainer's epoch and step at that moment."""

    def __init__(self, name: str, log: list, order: int = 0):
        self.name, self.log, self.order = name, log, order


for _event in ddpexp.callbacks.EVENTS:
    setattr(Recorder, _event, _recording(_event))


def test_events_fire_in_order_and_callbacks_by_their_order(tmp_path):
    log: list = []
    trainer = build_trainer(tmp_path, [*ARGS, "trainer.max_epochs=2", "trainer.test=false",
                                       "data.batch_size=48", "trainer.log_every_n_steps=1"])
    assert trainer.batches_per_epoch == 2
    recorders = {"late": Recorder("late", log, order=5), "early": Recorder("early", log, order=-5),
                 "mid": Recorder("mid", log)}
    trainer.callbacks = Dispatch({**dict(trainer.callbacks), **recorders})
    result = trainer.fit()
    mine = [(n, e, ep, st) for n, e, ep, st in log if n == "mid" and e != "setup"]
    events = [e for _, e, _, _ in mine]
    per_epoch = ["on_train_epoch_start", *["on_before_optimizer_step", "on_train_batch_end"] * 2,
                 "on_validation_start", "on_validation_end", "on_train_epoch_end",
                 "on_save_checkpoint"]  # the checkpoint callback runs last, and saves
    assert events == ["on_fit_start", *per_epoch, *per_epoch, "on_fit_end"], events
    # At every event the three run early, mid, late.
    assert [n for n, *_ in log[:3]] == ["early", "mid", "late"]
    # on_train_batch_end sees the step already counted; epoch end still sees its own epoch.
    assert ("mid", "on_train_batch_end", 0, 1) in mine and ("mid", "on_train_epoch_end", 1, 4) in mine
    assert result["status"] == "completed" and result["steps"] == 4


@pytest.mark.parametrize("entry, message", [
    (["+callbacks.bad.every=3"], "callbacks.bad has no _target_"),
    (["+callbacks.bad._target_=no_such_module.Thing"], "callbacks.bad._target_=no_such_module.Thing does not import"),
    (["+callbacks.bad._target_=collections.OrderedDict"], "is not a subclass of ddpexp.Callback"),
])
def test_a_bad_callback_entry_is_one_message_before_any_worker(workdir, monkeypatch, capsys, entry, message):
    code, out = run_cli_here([*ARGS, "trainer.max_epochs=1", *entry], workdir, monkeypatch, capsys)
    assert code != 0 and message in out, out
    assert "Traceback" not in out and out.count(message) == 1
    assert not list(workdir.glob("outputs/**/metrics.json"))  # nothing ran


class Counter(Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, trainer):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_a_state_without_its_callback_and_a_callback_without_state_are_one_warning_each(tmp_path, caplog):
    args = [*ARGS, "trainer.max_epochs=1", "trainer.test=false"]
    first = build_trainer(tmp_path, args)
    first.callbacks = Dispatch({**dict(first.callbacks), "counter": Counter()})
    first.fit()
    last = tmp_path / "checkpoints/last.pt"
    assert torch.load(last, weights_only=True)["callbacks"]["counter"] == {"steps": first.step}
    again = build_trainer(tmp_path, [*args, "trainer.max_epochs=2"])
    again.callbacks = Dispatch({**dict(again.callbacks), "other": Counter()})
    with caplog.at_level("WARNING", logger="ddpexp"):
        again.fit(resume_from=last)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings.count("callbacks.other has no state in the checkpoint: it starts afresh") == 1
    assert warnings.count("the checkpoint holds the state of callbacks counter, which this run "
                          "does not have: ignored") == 1
    assert dict(again.callbacks)["other"].steps == again.step - first.step
