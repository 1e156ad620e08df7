"""A checkpoint's weights evaluated by a trainer built in-process (training/evaluation.py)."""

from __future__ import annotations

import pytest
import torch

from ddpexp.callbacks import ModelCheckpoint
from ddpexp.errors import ConfigError
from ddpexp.training import evaluation


@pytest.fixture
def fitted(trainer_factory):
    t = trainer_factory("fit", callbacks={"checkpoint": ModelCheckpoint()}, max_epochs=2, test=False)
    result = t.fit()
    assert result["status"] == "completed"
    return t


def test_evaluate_checkpoint_on_test(fitted, trainer_factory):
    other = trainer_factory("eval", seed=5)
    result = evaluation.evaluate_checkpoint(other, fitted.checkpoint_callback.dirpath / "best.pt", "test")
    assert set(result) == {"metrics", "epoch", "samples"}
    assert set(result["metrics"]) == {"test/loss", "test/acc"}
    assert result["samples"] == 16
    saved = torch.load(fitted.checkpoint_callback.dirpath / "best.pt", weights_only=True)
    assert result["epoch"] == saved["history"][-1]["epoch"]
    for k, v in other.module.state_dict().items():  # left holding those weights
        assert torch.equal(v, saved["model"][k])


def test_evaluate_checkpoint_matches_fit_validation(fitted, trainer_factory):
    saved = torch.load(fitted.checkpoint_callback.dirpath / "last.pt", weights_only=True)
    other = trainer_factory("eval", seed=5)
    result = evaluation.evaluate_checkpoint(other, fitted.checkpoint_callback.dirpath / "last.pt", "val")
    assert result["metrics"] == pytest.approx(saved["metrics"])
    assert result["epoch"] == 1


def test_evaluate_missing_file_is_none(trainer_factory, tmp_path):
    assert evaluation.evaluate_checkpoint(trainer_factory(), tmp_path / "nope.pt") is None


def test_evaluate_without_test_split(trainer_factory, tmp_path):
    t = trainer_factory(samples=(16, 8, 0))
    with pytest.raises(ConfigError, match="data=Synthetic has no test split; evaluate split=val"):
        evaluation.evaluate_checkpoint(t, tmp_path / "x.pt", "test")


def test_evaluate_best_keeps_last_weights(fitted, caplog):
    import logging

    last = {k: v.clone() for k, v in fitted.module.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        result = evaluation.evaluate_best(fitted)
    assert set(result["metrics"]) == {"test/loss", "test/acc"}
    assert "test (best.pt, epoch" in caplog.text and "16 samples" in caplog.text
    for k, v in fitted.module.state_dict().items():
        assert torch.equal(v, last[k])


def test_evaluate_best_without_best_pt(trainer_factory, caplog):
    import logging

    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint()})
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        assert evaluation.evaluate_best(t) is None  # nothing saved yet
    assert "best.pt does not exist: test skipped" in caplog.text
    bare = trainer_factory("bare")
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        assert evaluation.evaluate_best(bare) is None
    assert "no checkpoint callback (~callbacks.checkpoint), so no best.pt: test skipped" in caplog.text


def test_evaluate_best_without_test_split(trainer_factory, caplog):
    import logging

    t = trainer_factory(samples=(16, 8, 0))
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        assert evaluation.evaluate_best(t) is None
    assert "no test split in data=Synthetic: test skipped" in caplog.text


def test_fit_result_holds_test_of_best(trainer_factory):
    t = trainer_factory(callbacks={"checkpoint": ModelCheckpoint()}, max_epochs=2)
    result = t.fit()
    assert set(result["test"]) == {"test/loss", "test/acc", "epoch"}
    assert result["test"]["epoch"] == result["best"]["epoch"]
