"""Metrics over a whole split, in this process: task.metrics=[f1,auroc] equal scikit-learn's
on the same predictions, trainer.monitor=val/auroc picks best.pt, task.thresholds bins the
AUROC, a user's torchmetrics object is logged, an unknown name is one message."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import build_trainer, read_scalars, run_cli_here
from sklearn.metrics import f1_score, roc_auc_score
from torch.utils.data import default_collate

from ddpexp.errors import ConfigError

METRICS = ["task.metrics=[f1,auroc]"]

# 17 samples in each split: none of 2, 3 and 7 workers divides it.
ODD = ["data=synthetic", "data.num_samples=48", "data.val_samples=17", "data.test_samples=17",
       "data.shape=[6]", "data.num_classes=4", "data.batch_size=4", "model=mlp",
       "model.hidden=[16]"]


def predictions(trainer, dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities of ``trainer``'s current weights over all of ``dataset``, and its
    labels, computed apart from the trainer's evaluation."""
    x, y = default_collate([dataset[i] for i in range(len(dataset))])
    trainer.module.eval()
    with torch.no_grad():
        return trainer.module(x).float().softmax(-1), y


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Three epochs on digits with f1 and auroc, best.pt picked by val/auroc."""
    run = tmp_path_factory.mktemp("auroc") / "run"
    trainer = build_trainer(run, [*METRICS, "trainer.max_epochs=3", "trainer.monitor=val/auroc"])
    return trainer, trainer.fit(), run


def test_f1_and_auroc_equal_scikit_learn_on_the_validation_split(fitted):
    trainer, result, _ = fitted
    probs, y = predictions(trainer, trainer.val_ds)  # the last epoch's weights
    final = result["final"]
    assert set(final) == {"val/loss", "val/acc", "val/f1", "val/auroc"}
    assert final["val/f1"] == pytest.approx(
        f1_score(y.numpy(), probs.argmax(1).numpy(), average="macro"), abs=1e-6)
    assert final["val/auroc"] == pytest.approx(
        roc_auc_score(y.numpy(), probs.numpy(), multi_class="ovr", average="macro"), abs=1e-6)
    assert {"test/f1", "test/auroc"} <= set(result["test"])


def test_monitor_val_auroc_picks_best_pt(fitted):
    _, result, run = fitted
    aurocs = [h["val/auroc"] for h in result["history"]]
    best = max(range(len(aurocs)), key=aurocs.__getitem__)
    assert result["monitor_mode"] == "max"
    assert result["best"] == {"val/auroc": aurocs[best], "epoch": best}
    saved = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    assert saved["history"][-1]["epoch"] == best
    assert result["test"]["epoch"] == best
    scalars = read_scalars(run / "tb")
    assert [v for _, v in scalars["val/auroc"]] == pytest.approx(aurocs, abs=1e-6)
    assert json.loads((run / "metrics.json").read_text())["best"]["val/auroc"] == aurocs[best]


def test_unknown_metric_is_one_message_with_the_known_ones(tmp_path: Path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match=r"bogus is not a metric of task=classification; "
                                          r"the known ones are f1, auroc"):
        build_trainer(tmp_path / "run", ["task.metrics=[f1,bogus]"])
    code, out = run_cli_here(["task.metrics=[f1,bogus]", "trainer.max_epochs=1"], tmp_path,
                             monkeypatch, capsys)
    assert code != 0 and out.count("the known ones are f1, auroc") == 1, out
    assert "Traceback" not in out


def test_binned_auroc_at_task_thresholds(tmp_path: Path):
    exact = build_trainer(tmp_path / "exact", [*ODD, *METRICS, "trainer.max_epochs=1"]).fit()
    binned = build_trainer(tmp_path / "binned", [*ODD, *METRICS, "trainer.max_epochs=1",
                                                 "task.thresholds=1000"]).fit()
    assert binned["final"]["val/f1"] == exact["final"]["val/f1"]
    assert binned["final"]["val/auroc"] == pytest.approx(exact["final"]["val/auroc"], abs=0.02)
    with pytest.raises(ConfigError, match=r"task.thresholds=1: null \(exact AUROC\) or an integer"):
        build_trainer(tmp_path / "bad", [*ODD, *METRICS, "task.thresholds=1"])


USER_TASK = '''
import torch.nn.functional as F
import torchmetrics

import ddpexp


class R2Regression(ddpexp.Task):
    """Mean squared error, and R2 over the whole split (not a mean over samples)."""

    monitor, monitor_mode = "val/r2", "max"

    def training_step(self, model, batch):
        x, y = batch
        pred = model(x).squeeze(-1)
        # "outputs" is not logged: it is what the split's metric objects are fed.
        return {"loss": F.mse_loss(pred, y), "outputs": pred.detach()}

    def split_metrics(self):
        return {"r2": torchmetrics.R2Score()}
'''


def test_user_task_with_a_torchmetrics_object_logs_it(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "r2task.py").write_text(textwrap.dedent(USER_TASK))
    conf = tmp_path / "conf" / "task"
    conf.mkdir(parents=True)
    (conf / "r2.yaml").write_text("_target_: r2task.R2Regression\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out = run_cli_here(["--config-dir", str(tmp_path / "conf"), "task=r2", "data=diabetes",
                              "model=mlp", "trainer.max_epochs=2"], tmp_path, monkeypatch, capsys)
    assert code == 0, out
    (metrics_json,) = (tmp_path / "outputs").glob("*/*/metrics.json")
    m = json.loads(metrics_json.read_text())
    assert m["monitor"] == "val/r2" and "val/r2" in m["best"]
    assert {"val/loss", "val/r2"} == set(m["final"]) and "test/r2" in m["test"]
    scalars = read_scalars(metrics_json.parent / "tb")
    assert [v for _, v in scalars["val/r2"]] == pytest.approx(
        [h["val/r2"] for h in m["history"]], abs=1e-6)
    assert "train/outputs" not in scalars and "test/r2" in scalars
    # The sweep summary and ddpexp.report are written from the same rows.
    from ddpexp import report

    header, row = report.format_rows(report.collect(tmp_path / "outputs"), "csv").splitlines()[:2]
    columns = dict(zip(header.split(","), row.split(","), strict=False))
    assert float(columns["test/r2"]) == pytest.approx(m["test"]["test/r2"], abs=1e-4)
