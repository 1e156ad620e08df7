"""Metrics over a whole split: task.metrics=[f1,auroc] equal scikit-learn's on the same
predictions; one checkpoint evaluated on 1, 2 and 3 workers gives the same values; a
user's task with a torchmetrics object logs it to TensorBoard and metrics.json;
trainer.monitor=val/auroc picks best.pt; task.thresholds bins the AUROC; an unknown name is
one message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import build_trainer, run_cli

METRICS = ["task.metrics=[f1,auroc]"]

# 17 samples in each split: neither 2 nor 3 workers divides it (the shards are padded).
ODD = ["data=synthetic", "data.num_samples=48", "data.val_samples=17", "data.test_samples=17",
       "data.shape=[6]", "data.num_classes=4", "data.batch_size=4", "model=mlp",
       "model.hidden=[16]"]


@pytest.mark.slow
def test_one_checkpoint_gives_the_same_values_on_1_2_and_3_workers(tmp_path: Path):
    run = tmp_path / "run"
    build_trainer(run, [*ODD, *METRICS, "trainer.max_epochs=1"]).fit()
    values = {}
    for procs in (1, 2, 3):
        res = run_cli([str(run), f"trainer.procs={procs}"], tmp_path, module="ddpexp.eval",
                      timeout=120)
        assert "Traceback" not in res.stderr
        (record,) = [json.loads(p.read_text()) for p in run.glob("eval-*.json")
                     if json.loads(p.read_text())["world_size"] == procs]
        assert record["samples"] == 17
        values[procs] = record["metrics"]
    for procs in (2, 3):
        for name in ("test/f1", "test/auroc", "test/acc"):
            assert values[procs][name] == pytest.approx(values[1][name], abs=1e-6), (procs, name)
