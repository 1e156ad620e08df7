"""The checks before the first step (training/probe.py), on trainers built in-process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpexp.data.base import InMemory
from ddpexp.errors import ConfigError
from ddpexp.models import MLP, ConvNet
from ddpexp.training import probe


class Sum:
    def training_step(self, model, batch):
        x, _ = batch
        return {"loss": model(x).float().pow(2).mean()}


class ViewNet(nn.Module):
    """A model that breaks on channels_last tensors (x.view of a permuted layout)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        x = self.conv(x)
        return self.fc(x.view(x.shape[0], -1))


def test_probe_sets_divergence_start(trainer_factory):
    t = trainer_factory(divergence_factor=10.0)
    start = t.divergence.ceiling.start
    assert start is not None and 0.5 < start < 2.0  # cross-entropy of 3 classes near ln 3
    assert t.val_names == ["loss", "acc"]


def test_monitor_the_task_does_not_return(trainer_factory):
    with pytest.raises(ConfigError, match=r"trainer.monitor=val/f1 is not a metric of the task "
                                          r"\(Classify\); it returns val/loss, val/acc"):
        trainer_factory(monitor="val/f1")


def test_model_that_cannot_take_the_batch(trainer_factory):
    with pytest.raises(ConfigError, match=r"the model \(MLP\) cannot take a batch of the data "
                                          r"with task Classify: mat1 and mat2 shapes cannot be "
                                          r"multiplied"):
        trainer_factory(model=MLP([5], 3, hidden=(4,)))


def test_task_without_loss(trainer_factory):
    class NoLoss:
        def training_step(self, model, batch):
            return {"acc": torch.tensor(1.0)}

    with pytest.raises(ConfigError, match="NoLoss: training_step must return a dict of scalar tensors"):
        trainer_factory(task=NoLoss())


def test_channels_last_fallback_warns(trainer_factory, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        t = trainer_factory(model=ViewNet(), shape=(3, 4, 4), task=Sum())
    assert t.memory_format is torch.preserve_format
    assert "the model (ViewNet) fails on channels_last tensors" in caplog.text


def test_channels_last_asked_is_refused(trainer_factory):
    with pytest.raises(ConfigError, match=r"the model \(ViewNet\) fails on channels_last tensors "
                                          r".*Set trainer.channels_last=false"):
        trainer_factory(model=ViewNet(), shape=(3, 4, 4), task=Sum(), channels_last=True)


def test_memory_format_rules(trainer_config):
    cpu = torch.device("cpu")
    conv = ConvNet([1, 4, 4], 2)
    assert probe.memory_format(conv, trainer_config(), cpu) == (torch.channels_last, False)
    assert probe.memory_format(ViewNet(), trainer_config(), cpu) == (torch.channels_last, True)
    assert probe.memory_format(MLP([4], 2), trainer_config(), cpu) == (torch.preserve_format, False)
    assert probe.memory_format(conv, trainer_config(channels_last=False), cpu) == (torch.preserve_format, False)
    assert probe.memory_format(conv, trainer_config(channels_last=True), cpu) == (torch.channels_last, True)
    assert probe.memory_format(conv, trainer_config(strategy="fsdp"), cpu) == (torch.preserve_format, False)
    with pytest.raises(ConfigError, match="trainer.channels_last=true with trainer.strategy=fsdp"):
        probe.memory_format(conv, trainer_config(strategy="fsdp", channels_last=True), cpu)


def test_channels_last_pays():
    conv, mlp = ConvNet([1, 4, 4], 2), MLP([4], 2)
    assert probe.channels_last_pays(conv, torch.device("cpu"), "32")
    assert not probe.channels_last_pays(mlp, torch.device("cpu"), "32")
    assert not probe.channels_last_pays(conv, torch.device("cuda"), "32")
    assert probe.channels_last_pays(conv, torch.device("cuda"), "bf16")


def test_check_sample_shape():
    train = InMemory(torch.zeros(3, 1, 8, 8), torch.zeros(3, dtype=torch.long))
    probe.check_sample_shape({"shape": [1, 8, 8]}, train)
    probe.check_sample_shape({"shape": None}, train)
    with pytest.raises(ConfigError, match=r"data.shape=\[3, 8, 8\] but the samples of data my.Data "
                                          r"have shape \[1, 8, 8\]; set data.shape=\[1, 8, 8\]"):
        probe.check_sample_shape({"shape": [3, 8, 8], "_target_": "my.Data"}, train)


def test_first_line():
    assert probe.first_line(ValueError("bad thing.\nmore")) == "bad thing"
    assert probe.first_line(KeyError()) == "KeyError"
