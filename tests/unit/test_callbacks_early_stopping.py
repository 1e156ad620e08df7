"""Early stopping's counting (callbacks/early_stopping.py), alone and through a fit."""

from __future__ import annotations

import pytest

from ddpexp.callbacks import EarlyStopping, ModelCheckpoint
from ddpexp.errors import ConfigError


class Asks:
    """The part of a trainer early stopping talks to: its monitor and request_stop."""

    monitor, monitor_mode = "val/acc", "max"

    def __init__(self):
        self.requests = []

    def request_stop(self, reason, status="stopped"):
        self.requests.append((reason, status))


def run(cb, values, monitor="val/acc"):
    t = Asks()
    cb.setup(t)
    for v in values:
        cb.on_train_epoch_end(t, {monitor: v})
    return t.requests


def test_counts_validations_without_strict_improvement():
    cb = EarlyStopping(patience=2)
    assert run(cb, [0.5, 0.6, 0.6]) == []
    assert (cb.best, cb.bad_epochs) == (0.6, 1)
    t = Asks()
    cb.on_train_epoch_end(t, {"val/acc": 0.55})
    assert t.requests == [("early stop: val/acc did not improve for 2 epochs", "early_stopped")]


def test_improvement_resets_counter():
    cb = EarlyStopping(patience=2)
    assert run(cb, [0.5, 0.4, 0.7, 0.6]) == []
    assert cb.bad_epochs == 1 and cb.best == 0.7


def test_min_mode_and_min_delta():
    cb = EarlyStopping(patience=1, monitor="val/loss", mode="min", min_delta=0.1)
    assert run(cb, [1.0, 0.95], monitor="val/loss") == [
        ("early stop: val/loss did not improve for 1 epochs", "early_stopped")]
    assert cb.best == 1.0


def test_nan_is_never_an_improvement():
    cb = EarlyStopping(patience=3)
    run(cb, [float("nan"), float("nan")])
    assert cb.best is None and cb.bad_epochs == 2


def test_unknown_monitor():
    cb = EarlyStopping(patience=1, monitor="val/f1")
    with pytest.raises(ConfigError, match=r"callbacks.early_stopping.monitor=val/f1 is not a "
                                          r"validation metric of the run \(val/acc\)"):
        run(cb, [0.1])


def test_bad_arguments():
    with pytest.raises(ConfigError, match=r"callbacks.early_stopping.patience=0 must be >= 1 \(or null\)"):
        EarlyStopping(patience=0)
    with pytest.raises(ConfigError, match="callbacks.early_stopping.mode='up' is not one of min, max"):
        EarlyStopping(patience=1, mode="up")
    assert not EarlyStopping().enabled


def test_state_round_trip():
    cb = EarlyStopping(patience=4)
    run(cb, [0.3, 0.2])
    other = EarlyStopping(patience=4)
    other.load_state_dict(cb.state_dict())
    assert other.state_dict() == {"best": 0.3, "bad_epochs": 1}


def test_fit_stops_early_with_status_and_reason(trainer_factory):
    # lr=0: the weights never change, so val/acc never improves after the first epoch
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint(), "es": EarlyStopping(patience=2)},
                        max_epochs=6, lr=0.0)
    result = t.fit()
    assert result["status"] == "early_stopped"
    assert result["epochs"] == 3 and len(result["history"]) == 3
    assert result["stop_reason"] == "early stop: val/acc did not improve for 2 epochs"
    import torch

    saved = torch.load(t.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["callbacks"]["es"]["bad_epochs"] == 2 and saved["epoch"] == 3
