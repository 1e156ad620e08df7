"""A task's metric objects over a whole split (training/split_metrics.py)."""

from __future__ import annotations

import pytest
import torch

from ddpexp.errors import ConfigError
from ddpexp.task import Task
from ddpexp.training.split_metrics import SplitMetrics

CPU = torch.device("cpu")


class Count:
    """A metric object of the protocol: the fraction of outputs equal to their target."""

    def __init__(self, width=1):
        self.width = width
        self.reset()

    def update(self, outputs, target):
        self.hits += int((outputs == target).sum())
        self.n += len(target)

    def compute(self):
        return torch.full((self.width,), self.hits / max(self.n, 1))

    def reset(self):
        self.hits, self.n = 0, 0


class Counting(Task):
    def __init__(self, metrics):
        self.built = metrics

    def split_metrics(self):
        return self.built


def test_no_metrics_is_falsy():
    s = SplitMetrics(Task(), CPU)
    assert not s and s.names == []


def test_update_compute_reset():
    s = SplitMetrics(Counting({"hit": Count(), "hit2": Count()}), CPU)
    assert s and s.names == ["hit", "hit2"]
    y = torch.tensor([0, 1, 2, 3])
    s.update({"outputs": torch.tensor([0, 1, 0, 0])}, (None, y))
    s.update({"outputs": torch.tensor([5, 5])}, (None, torch.tensor([5, 6])))
    assert s.compute("val") == {"val/hit": 0.5, "val/hit2": 0.5}
    assert s.metrics["hit"].n == 0  # reset after compute


def test_split_metrics_must_be_a_dict():
    with pytest.raises(ConfigError, match="task Counting: split_metrics\\(\\) must return a dict "
                                          "of metric objects by name; got list"):
        SplitMetrics(Counting([Count()]), CPU)


def test_metric_objects_need_the_protocol():
    with pytest.raises(ConfigError, match=r"split_metrics\(\)\['f'\] is a int without update, "
                                          r"compute, reset"):
        SplitMetrics(Counting({"f": 3}), CPU)
    with pytest.raises(ConfigError, match=r"split_metrics\(\)\[1\] is a Count without a string name"):
        SplitMetrics(Counting({1: Count()}), CPU)


def test_metric_of_several_numbers_is_refused():
    s = SplitMetrics(Counting({"per_class": Count(width=3)}), CPU)
    s.update({"outputs": torch.tensor([1])}, (None, torch.tensor([1])))
    with pytest.raises(ConfigError, match=r"metric 'per_class' computed a tensor of shape \[3\]; "
                                          r"a logged metric must be one number"):
        s.compute("val")


def test_trainer_probe_refuses_clashing_names(trainer_factory):
    class Clash:
        monitor = "val/loss"

        def training_step(self, model, batch):
            return {"loss": model(batch[0]).pow(2).mean()}

        def split_metrics(self):
            return {"loss": Count()}

    with pytest.raises(ConfigError, match="task Clash: split_metrics\\(\\) and validation_step both "
                                          "name loss; give each metric one name"):
        trainer_factory(task=Clash())


def test_trainer_probe_refuses_metric_that_cannot_update(trainer_factory):
    class Unfed:
        monitor = "val/loss"

        def training_step(self, model, batch):
            return {"loss": model(batch[0]).pow(2).mean()}

        def split_metrics(self):
            return {"hit": Count()}

    with pytest.raises(ConfigError, match="task Unfed: its metric objects cannot take a validation batch"):
        trainer_factory(task=Unfed())


def test_trainer_evaluates_split_metric_over_whole_split(trainer_factory):
    class Argmax:
        monitor = "val/hit"
        monitor_mode = "max"

        def training_step(self, model, batch):
            from ddpexp.task import Classification

            out = Classification._metrics_of(model(batch[0]), batch[1])
            out["outputs"] = model(batch[0]).argmax(1)
            return out

        def split_metrics(self):
            return {"hit": Count()}

    t = trainer_factory(task=Argmax())
    values = t.evaluate(t.val_loader, "val")
    assert set(values) == {"val/loss", "val/acc", "val/hit"}
    assert values["val/hit"] == pytest.approx(values["val/acc"])
