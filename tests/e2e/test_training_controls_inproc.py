"""Training controls in this process: channels_last by default where the model takes it (and
one message where it cannot), a user model's error keeps its cause, the step schedule counts
epochs in optimizer steps."""

from __future__ import annotations

import logging
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from helpers import build_trainer

from ddpexp.errors import ConfigError


@pytest.mark.parametrize("overrides,expected", [
    (["model=convnet"], True),  # trainer.channels_last=null: a conv model on the CPU
    (["model=convnet", "trainer.channels_last=false"], False),
    (["model=mlp"], False),  # no convolution: its batches are not reordered
    (["model=mlp", "trainer.channels_last=true"], True),
])
def test_channels_last_default_follows_the_model(tmp_path, overrides, expected):
    """The trainer's weights and the 4-d batches it trains on are channels_last exactly where
    the setting (or, left null, the model having 2-d convolutions on the CPU) says so."""
    trainer = build_trainer(tmp_path, ["data=synthetic", "data.num_samples=8", "data.val_samples=4",
                                       "data.shape=[3,8,8]", "data.batch_size=4", *overrides])
    x, _ = trainer.to_device(next(iter(trainer.train_loader)))
    cl = torch.channels_last
    assert x.dim() == 4 and x.is_contiguous(memory_format=cl) is expected
    convs = [m.weight for m in trainer.module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=cl) is expected for w in convs)


# The model of PyTorch's DDP tutorial and of LeNet-style examples: it flattens with
# x.view(x.size(0), -1), which only a contiguous (NCHW) tensor allows.
TUTORIAL_MODELS = textwrap.dedent('''
    import torch.nn.functional as F
    from torch import nn


    class Net(nn.Module):
        def __init__(self, shape, num_classes, fc_in=None):
            super().__init__()
            c, h, w = shape
            self.conv1 = nn.Conv2d(c, 6, 3, padding=1)
            self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
            self.pool = nn.MaxPool2d(2)
            self.fc1 = nn.Linear(fc_in or 16 * (h // 4) * (w // 4), 32)
            self.fc2 = nn.Linear(32, num_classes)

        def forward(self, x):
            x = self.pool(F.relu(self.conv1(x)))
            x = self.pool(F.relu(self.conv2(x)))
            x = x.view(x.size(0), -1)
            x = F.relu(self.fc1(x))
            return self.fc2(x)
''')


@pytest.fixture
def tutorial_conf(tmp_path: Path):
    """A user's module (``tutorial_models``) and config dir with ``model=tutorial``."""
    (tmp_path / "tutorial_models.py").write_text(TUTORIAL_MODELS)
    conf = tmp_path / "my_conf" / "model"
    conf.mkdir(parents=True)
    (conf / "tutorial.yaml").write_text(
        "_target_: tutorial_models.Net\nshape: ${data.shape}\nnum_classes: ${data.num_classes}\n")
    sys.path.insert(0, str(tmp_path))
    yield conf.parent
    sys.path.remove(str(tmp_path))
    sys.modules.pop("tutorial_models", None)


SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.test=false"]


@pytest.mark.parametrize("data", [
    ["data=synthetic", "data.shape=[3,10,10]", "data.num_samples=64", "data.val_samples=16",
     "data.batch_size=16"],
    [],  # the default digits, 1x8x8
])
def test_a_model_that_flattens_with_view_trains_under_the_defaults(tmp_path, tutorial_conf,
                                                                   caplog, data):
    """trainer.channels_last=null tries channels_last on a user's conv model; where the model
    cannot take it, the run trains in the model's own layout, with one warning naming the key."""
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        trainer = build_trainer(tmp_path / "run", ["model=tutorial", *data, *SHORT],
                                config_dir=tutorial_conf)
        result = trainer.fit()
    assert result["status"] == "completed" and result["steps"] == 2
    warnings = [r.getMessage() for r in caplog.records if "channels_last" in r.getMessage()]
    assert len(warnings) == 1 and "trainer.channels_last=false" in warnings[0]
    assert not trainer.module.conv2.weight.is_contiguous(memory_format=torch.channels_last)


def test_the_built_in_convnet_keeps_channels_last_by_default(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        trainer = build_trainer(tmp_path, SHORT)  # the default run: convnet on digits, CPU
    convs = [m.weight for m in trainer.module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert not [r for r in caplog.records if "channels_last" in r.getMessage()]


def test_channels_last_true_on_a_model_that_cannot_take_it_names_the_key(tmp_path, tutorial_conf):
    with pytest.raises(ConfigError, match=r"trainer.channels_last=true asks for.*"
                                          r"Set trainer.channels_last=false") as caught:
        build_trainer(tmp_path, ["model=tutorial", "trainer.channels_last=true", *SHORT],
                      config_dir=tutorial_conf)
    assert "view size is not compatible" in str(caught.value.__cause__)


def test_an_error_in_a_user_model_keeps_its_cause(tmp_path, tutorial_conf):
    """A model whose first layer after the flatten has the wrong size: the message is one
    line, and the error the model raised is its cause, traceback and all (which is what
    HYDRA_FULL_ERROR=1 prints)."""
    with pytest.raises(ConfigError, match=r"the model \(Net\) cannot take a batch") as caught:
        build_trainer(tmp_path, ["model=tutorial", "+model.fc_in=7", *SHORT], config_dir=tutorial_conf)
    cause = caught.value.__cause__
    assert isinstance(cause, RuntimeError) and "cannot be multiplied" in str(cause)
    frames = traceback.extract_tb(cause.__traceback__)
    assert any(f.filename.endswith("tutorial_models.py") and f.name == "forward" for f in frames)


def test_channels_last_default_on_gpus_only_with_tensor_core_precisions():
    from ddpexp.models import MLP, ConvNet
    from ddpexp.training.probe import channels_last_pays as _channels_last_pays

    conv, mlp = ConvNet(input_shape=[3, 8, 8], num_classes=2), MLP(input_shape=[3, 8, 8], num_classes=2)
    cuda = torch.device("cuda", 0)
    assert _channels_last_pays(conv, cuda, "bf16") and _channels_last_pays(conv, cuda, "16")
    assert not _channels_last_pays(conv, cuda, "32")
    assert not _channels_last_pays(mlp, cuda, "bf16")


def test_step_schedule_counts_epochs_in_optimizer_steps():
    """With accumulation an epoch has fewer optimizer steps; the step schedule decays per
    epoch all the same (built the way the trainer builds it)."""
    from ddpexp.schedulers import step

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = step(opt, total_steps=9, steps_per_epoch=3, step_size=1, gamma=0.1)
    lrs = []
    for _ in range(9):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01])
