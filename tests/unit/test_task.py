"""The tasks (task.py): metrics of a batch, defaults of a user's own task, checks and errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddpexp import task as tasks
from ddpexp.errors import ConfigError


class Fixed(nn.Module):
    """Returns the given outputs whatever its input."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out


def test_classification_loss_and_acc():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    out = tasks.Classification().training_step(Fixed(logits), (torch.zeros(3), y))
    assert set(out) == {"loss", "acc"}
    assert float(out["acc"]) == pytest.approx(2 / 3) and out["acc"].dtype == torch.float64
    assert float(out["loss"]) == pytest.approx(float(nn.functional.cross_entropy(logits, y)))


def test_classification_validation_outputs_only_with_metrics():
    logits = torch.tensor([[1.0, 0.0]])
    batch = (torch.zeros(1), torch.tensor([0]))
    assert "outputs" not in tasks.Classification().validation_step(Fixed(logits), batch)
    out = tasks.Classification(metrics=["f1"], num_classes=2).validation_step(Fixed(logits), batch)
    assert torch.allclose(out["outputs"], logits.softmax(-1))


def test_classification_metric_names_checked():
    with pytest.raises(ConfigError, match="task.metrics: top5 is not a metric of task=classification; "
                                          "the known ones are f1, auroc"):
        tasks.Classification(metrics=["top5"], num_classes=3)
    with pytest.raises(ConfigError, match=r"task.metrics needs task.num_classes >= 2 \(got 1\)"):
        tasks.Classification(metrics=["f1"], num_classes=1)
    with pytest.raises(ConfigError, match=r"task.thresholds=True: null \(exact AUROC\) or an integer >= 2"):
        tasks.Classification(metrics=["auroc"], num_classes=3, thresholds=True)


def test_classification_check_labels():
    c = tasks.Classification()
    model = Fixed(torch.zeros(2, 3))
    c.check(model, (torch.zeros(2), torch.tensor([0, 2])))
    with pytest.raises(ConfigError, match="task=classification needs integer class labels, but the "
                                          "data gives torch.float32 labels"):
        c.check(model, (torch.zeros(2), torch.tensor([0.0, 1.0])))
    with pytest.raises(ConfigError, match=r"the data has labels from 0 to 4, but the model outputs "
                                          r"3 classes \(data.num_classes\). Set data.num_classes=5"):
        c.check(model, (torch.zeros(2), torch.tensor([0, 4])))


def test_classification_needs_pairs_and_tensors():
    c = tasks.Classification()
    with pytest.raises(ConfigError, match="task=classification expects batches \\(inputs, targets\\); got dict"):
        c.training_step(Fixed(torch.zeros(1, 2)), {"x": torch.zeros(1)})
    with pytest.raises(ConfigError, match="task=classification: the model returned tuple, not a tensor"):
        c.training_step(Fixed((torch.zeros(1, 2),)), (torch.zeros(1), torch.tensor([0])))


def test_regression_metrics():
    pred = torch.tensor([[1.0], [3.0]])
    out = tasks.Regression().training_step(Fixed(pred), (torch.zeros(2), torch.tensor([0.0, 1.0])))
    assert float(out["mse"]) == pytest.approx((1 + 4) / 2)
    assert float(out["mae"]) == pytest.approx(1.5)
    assert float(out["loss"]) == float(out["mse"])


def test_regression_multi_target_per_sample_mean():
    pred = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    out = tasks.Regression().training_step(Fixed(pred), (None, torch.zeros(2, 2)))
    assert float(out["mse"]) == pytest.approx(1.5)


def test_regression_shape_mismatch():
    with pytest.raises(ConfigError, match=r"task=regression: the model predicts \[2, 3\] for targets "
                                          r"of shape \[2\]; give the model one output per target"):
        tasks.Regression().training_step(Fixed(torch.zeros(2, 3)), (None, torch.zeros(2)))


def test_language_model():
    logits = torch.zeros(2, 3, 5)
    logits[..., 1] = 10.0
    y = torch.tensor([[1, 1, 0], [1, 1, 1]])
    lm = tasks.LanguageModel()
    out = lm.training_step(Fixed(logits), (None, y))
    assert float(out["acc"]) == pytest.approx(5 / 6)
    assert lm.derived({"loss": 2.0}) == {"ppl": pytest.approx(math.exp(2.0))}
    assert lm.derived({"loss": 1e6})["ppl"] == pytest.approx(math.exp(700.0))
    assert lm.derived({}) == {}
    with pytest.raises(ConfigError, match=r"task=lm: the model returned \[2, 5\] for tokens \[2, 3\]"):
        lm.training_step(Fixed(torch.zeros(2, 5)), (None, y))


def test_batch_size_and_first_tensor():
    t = tasks.Task()
    assert t.batch_size({"meta": "x", "inputs": [torch.zeros(4, 2)], "y": torch.zeros(9)}) == 4
    assert tasks.first_tensor(("a", {"b": None})) is None
    with pytest.raises(ConfigError, match="task Task: a batch holds no tensor, so its size is unknown"):
        t.batch_size(["no", "tensors"])


def test_as_task_wraps_plain_class():
    class Mine:
        monitor = "val/score"
        monitor_mode = "max"
        extra = 7

        def training_step(self, model, batch):
            return {"loss": torch.tensor(1.0)}

    wrapped = tasks.as_task(Mine())
    assert isinstance(wrapped, tasks.Task) and type(wrapped).__name__ == "Mine"
    assert wrapped.monitor == "val/score" and wrapped.extra == 7
    assert wrapped.validation_step(None, None) == {"loss": torch.tensor(1.0)}
    assert wrapped.derived({}) == {} and wrapped.split_metrics() == {}
    c = tasks.Classification()
    assert tasks.as_task(c) is c


def test_as_task_needs_training_step():
    with pytest.raises(ConfigError, match="task._target_ built a object without a training_step"):
        tasks.as_task(object())


def test_update_metrics_feeds_outputs_and_target():
    seen = []

    class Metric:
        def update(self, outputs, target):
            seen.append((outputs, target.tolist()))

    tasks.Task().update_metrics({"m": Metric()}, "out", (torch.zeros(2), torch.tensor([3, 4])))
    assert seen == [("out", [3, 4])]


def test_no_split_metric_imports_no_torchmetrics(monkeypatch):
    """torchmetrics costs every worker about a second of import: a task that asks for no
    split metric must not import it (a None in sys.modules makes any import of it raise)."""
    import sys

    monkeypatch.setitem(sys.modules, "torchmetrics.classification", None)
    assert tasks.Classification().split_metrics() == {}
    with pytest.raises(ImportError):
        tasks.Classification(metrics=["f1"], num_classes=3).split_metrics()
