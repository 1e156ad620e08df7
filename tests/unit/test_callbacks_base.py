"""The callback seam (callbacks/base.py): dispatch order, and what a callback may do to a
run (request_stop, log_metrics), through fits of a few steps; the lr monitor's arguments."""

from __future__ import annotations

import pytest
import torch

from ddpexp.callbacks import (
    EARLY,
    LAST,
    LATE,
    Callback,
    Dispatch,
    LearningRateMonitor,
    ModelCheckpoint,
)
from ddpexp.callbacks.base import EVENTS, overrides
from ddpexp.errors import ConfigError
from ddpexp.loggers.csv import CSVLogger, read_rows


class Recorder(Callback):
    def __init__(self, calls, name, order=0, enabled=True):
        self.calls, self.name, self.order, self.enabled = calls, name, order, enabled

    def on_fit_start(self, trainer):
        self.calls.append(self.name)


def test_dispatch_orders_by_order_then_name():
    calls = []
    d = Dispatch({"z": Recorder(calls, "z"), "last": Recorder(calls, "last", LAST),
                  "a": Recorder(calls, "a"), "early": Recorder(calls, "early", EARLY),
                  "late": Recorder(calls, "late", LATE), "off": Recorder(calls, "off", enabled=False)})
    d.fire("on_fit_start", None)
    assert calls == ["early", "a", "z", "late", "last"]
    assert [name for name, _ in d] == ["early", "a", "z", "late", "last"]
    d.fire("on_train_batch_end", None)  # no callback implements it


def test_overrides():
    assert overrides(Recorder([], "x"), "on_fit_start")
    assert not overrides(Recorder([], "x"), "on_fit_end")
    assert EVENTS[0] == "setup" and "on_save_checkpoint" in EVENTS


def test_events_fire_in_documented_order(trainer_factory):
    class Order(Callback):
        def __init__(self):
            self.seen = []

        def on_fit_start(self, t): self.seen.append("fit_start")
        def on_train_epoch_start(self, t): self.seen.append("epoch_start")
        def on_before_optimizer_step(self, t): self.seen.append("before_step")
        def on_train_batch_end(self, t): self.seen.append(("batch_end", t.step))
        def on_validation_end(self, t, m): self.seen.append(("val_end", sorted(m)))
        def on_train_epoch_end(self, t, m): self.seen.append("epoch_end")
        def on_fit_end(self, t, r): self.seen.append(("fit_end", r["status"]))

    cb = Order()
    trainer_factory(samples=(16, 8, 0), callbacks={"order": cb}, max_epochs=1).fit()
    assert cb.seen == ["fit_start", "epoch_start", "before_step", ("batch_end", 1), "before_step",
                       ("batch_end", 2), ("val_end", ["val/acc", "val/loss"]), "epoch_end",
                       ("fit_end", "completed")]


def test_request_stop_during_epoch_end_ends_run_after_its_checkpoint(trainer_factory):
    class Stopper(Callback):
        def on_train_epoch_end(self, trainer, metrics):
            trainer.request_stop("enough for today")

    t = trainer_factory(callbacks={"stop": Stopper(), "checkpoint": ModelCheckpoint()}, max_epochs=4)
    result = t.fit()
    assert result["status"] == "stopped" and result["epochs"] == 1
    assert result["stop_reason"] == "enough for today"
    assert torch.load(t.run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1


def test_request_stop_mid_epoch_one_process_stops_at_once(trainer_factory):
    # one process has nobody to agree with: the stop takes effect after the asking step
    class Stopper(Callback):
        def on_train_batch_end(self, trainer):
            if trainer.step == 1:
                trainer.request_stop("at once", status="pruned")

    result = trainer_factory(callbacks={"stop": Stopper()}, max_epochs=3, log_every_n_steps=2).fit()
    assert result["status"] == "pruned" and result["steps"] == 1 and result["epochs"] == 0


def test_log_metrics_from_a_callback(trainer_factory, tmp_path):
    class Logs(Callback):
        def on_train_epoch_end(self, trainer, metrics):
            trainer.log_metrics({"custom/epoch": float(trainer.epoch)})

    trainer_factory(samples=(16, 8, 0), callbacks={"logs": Logs()}, loggers={"csv": CSVLogger()},
                    max_epochs=2).fit()
    rows = [(s, v) for s, _, n, v in read_rows(tmp_path / "run" / "metrics.csv") if n == "custom/epoch"]
    assert rows == [(2, 0.0), (4, 1.0)]


def test_lr_monitor_every_n_steps_and_groups(trainer_factory, tmp_path):
    with pytest.raises(ConfigError, match="callbacks.lr_monitor.every_n_steps=0 must be >= 1"):
        LearningRateMonitor(every_n_steps=0)
    trainer_factory(callbacks={"lr": LearningRateMonitor(every_n_steps=3, name="lr")},
                    loggers={"csv": CSVLogger()}, max_epochs=2, lr=0.2).fit()
    rows = [(s, v) for s, _, n, v in read_rows(tmp_path / "run" / "metrics.csv") if n == "lr"]
    assert rows == [(3, 0.2), (6, 0.2)]


def test_divergence_stops_run_and_keeps_last_finite_checkpoint(trainer_factory):
    class Blow(Callback):
        def on_before_optimizer_step(self, trainer):
            if trainer.epoch == 1:
                for p in trainer.module.parameters():
                    p.grad.fill_(float("nan"))

    t = trainer_factory(callbacks={"blow": Blow(), "checkpoint": ModelCheckpoint()}, max_epochs=3)
    result = t.fit()
    assert result["status"] == "diverged"
    assert result["diverged_at_step"] == 6  # the NaN step 5 made shows at the log step after it
    assert result["error"].startswith("training diverged: the training loss became NaN by step 6 (epoch 1)")
    assert "checkpoints/last.pt keeps the last finite weights (step 4)" in result["error"]
    assert "test" not in result
    saved = torch.load(t.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["epoch"] == 1 and saved["step"] == 4
    assert all(torch.isfinite(v).all() for v in saved["model"].values())
