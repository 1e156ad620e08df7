"""A user callback whose state holds numpy arrays and scalars: saved in every checkpoint,
handed back on resume, and the files stay readable by a plain ``torch.load(weights_only=True)``
and by ``ddpexp.eval``; a state a checkpoint cannot hold is refused at the first save, naming
the callback and the key."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_trainer, read_metrics

from ddpexp.errors import ConfigError

PLUGINS = str(Path(__file__).parents[1] / "plugins")
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=32",
        "data.val_samples=16", "data.test_samples=16", "data.batch_size=8", "model=mlp",
        "model.hidden=[8]", "trainer.log_every_n_steps=2"]


def test_numpy_state_survives_save_resume_eval_and_a_plain_safe_load(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    run = tmp_path / "run"
    args = [*TINY, "+callbacks.stats._target_=userstate.NumpyStats"]
    first = build_trainer(run, [*args, "trainer.max_epochs=2"]).fit()
    assert first["status"] == "completed" and "test" in first  # best.pt was read back
    last = run / "checkpoints" / "last.pt"
    saved = torch.load(last, weights_only=True)["callbacks"]["stats"]
    assert saved["losses"]["__ddpexp_numpy__"] == "array" and saved["losses"]["shape"] == [2]
    assert torch.is_tensor(saved["losses"]["data"]) and saved["best"]["__ddpexp_numpy__"] == "scalar"

    resumed = build_trainer(run, [*args, "trainer.max_epochs=3"])
    assert resumed.fit(resume_from=last)["epochs"] == 3
    stats = dict(resumed.callbacks)["stats"]
    assert type(stats.loaded["losses"]) is np.ndarray and stats.loaded["losses"].dtype == np.float32
    assert type(stats.loaded["epochs"]) is np.int64 and stats.loaded["epochs"] == 2
    assert type(stats.loaded["seen"][0]) is np.int32
    assert stats.losses.shape == (3,) and stats.epochs == 3
    assert np.array_equal(stats.losses[:2], stats.loaded["losses"])

    from ddpexp import eval as ddpexp_eval

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = ddpexp_eval.main([str(run)])
    assert code == 0, err.getvalue()
    assert "test/acc" in out.getvalue()


def test_a_state_no_checkpoint_can_hold_is_refused_at_the_first_save(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    trainer = build_trainer(tmp_path, [*TINY, "trainer.max_epochs=5",
                                       "+callbacks.mine._target_=userstate.Unsaveable"])
    with pytest.raises(ConfigError) as err:
        trainer.fit()
    assert str(err.value).startswith("callbacks.mine: state_dict()['nested']['handle'] holds a "
                                     "userstate.Handle, which a checkpoint cannot hold")
    assert trainer.epoch == 0 and trainer.step == trainer.steps_per_epoch  # the first save
    assert not (tmp_path / "checkpoints" / "last.pt").exists()
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path)


def test_metrics_logged_before_the_optimizer_step_land_at_that_step(tmp_path, monkeypatch):
    import csv

    monkeypatch.syspath_prepend(PLUGINS)
    trainer = build_trainer(tmp_path, [*TINY, "trainer.max_epochs=1", "trainer.log_every_n_steps=1",
                                       "logger=csv", "+callbacks.grads._target_=userstate.GradLogger"])
    trainer.fit()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    steps = {name: [int(r["step"]) for r in rows if r["name"] == name]
             for name in ("probe/steps_done", "train/loss", "train/grad_norm")}
    assert steps["probe/steps_done"] == steps["train/loss"] == steps["train/grad_norm"] == [1, 2, 3, 4]
    values = [float(r["value"]) for r in rows if r["name"] == "probe/steps_done"]
    assert values == [0, 1, 2, 3]  # trainer.step still counts the steps done before
