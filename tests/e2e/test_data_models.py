"""Datasets from files in their real on-disk formats, the models, and user models, trained a
few steps through the CLI under each strategy (single, dp, ddp)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import (
    one_worker,
    only_run_dir,
    read_metrics,
    run_cli,
    run_cli_in_process,
    write_cifar10,
    write_imagefolder,
    write_mnist,
)

# A couple of optimizer steps, one validation, a TensorBoard point per step.
TINY = ["trainer.max_steps=2", "trainer.max_epochs=1", "trainer.log_every_n_steps=1",
        "data.batch_size=4"]


# ---------------------------------------------------------------- writers of real formats
def trained(cwd: Path, args: list[str], **kw) -> dict:
    """Run the CLI (in this process where the run is one worker) and return metrics.json
    after checking that it trained."""
    if one_worker(args):
        run_cli_in_process(args, cwd, **kw)
    else:
        run_cli(args, cwd, **kw)
    metrics = read_metrics(only_run_dir(cwd))
    assert metrics["status"] == "completed", metrics
    assert metrics["steps"] >= 1
    assert 0.0 <= metrics["final"]["val/acc"] <= 1.0
    return metrics


def test_mnist_gzipped_single(workdir):
    write_mnist(workdir / "d", gz=True)
    trained(workdir, ["data=mnist", "data.root=d", "trainer.strategy=single", *TINY])


def test_fashion_mnist_plain_dp(workdir):
    # On the CPU, DP is nn.DataParallel's pass-through: one process, the plain model.
    write_mnist(workdir / "d", name="FashionMNIST", gz=False)
    metrics = trained(workdir, ["data=fashion_mnist", "data.root=d", "trainer.strategy=dp", *TINY])
    assert metrics["world_size"] == 1


@pytest.mark.slow
def test_mnist_resnet18_ddp_two_procs(workdir):
    """MNIST-format files of 12x12 images, ResNet-18 on 1 channel, 2 gloo ranks."""
    write_mnist(workdir / "d", gz=True, size=(12, 12))
    metrics = trained(workdir, ["data=mnist", "data.root=d", "data.shape=[1,12,12]",
                                "model=resnet18", "trainer.procs=2", *TINY])
    assert metrics["world_size"] == 2


def test_mnist_with_train_transform(workdir):
    """A per-sample transform moves MNIST off the fast path onto a DataLoader."""
    write_mnist(workdir / "d", gz=True)
    trained(workdir, ["data=mnist", "data.root=d", *TINY,
                      "+data.train_transform=[{_target_: torchvision.transforms.RandomCrop, size: 28, padding: 2}]"])


def test_cifar10_python_batches_single(workdir):
    write_cifar10(workdir / "c")
    # The default config: RandomCrop + flip per sample on 2 loader workers.
    metrics = trained(workdir, ["data=cifar10", "data.root=c", "data.verify=false", *TINY])
    assert metrics["world_size"] == 1


def test_cifar10_refuses_unofficial_files_unless_verify_false(workdir):
    write_cifar10(workdir / "c")
    res = run_cli_in_process(["data=cifar10", "data.root=c", *TINY], workdir, expect_ok=False)
    assert res.returncode != 0
    assert "MD5" in res.stderr and "data.verify=false" in res.stderr
    assert "Traceback" not in res.stderr


def test_imagefolder_pngs_with_two_loader_workers(workdir):
    write_imagefolder(workdir / "imgs")
    trained(workdir, ["data=imagefolder", "data.root=imgs", "data.shape=[3,6,5]",
                      "data.num_workers=2", "data.prefetch_factor=3", *TINY])


def test_loader_settings_reach_the_dataloader(tmp_path):
    from torch.utils.data import DataLoader

    from ddpexp.data import ImageFolder, Synthetic, TensorLoader

    write_imagefolder(tmp_path)
    source = ImageFolder(root=str(tmp_path), shape=[1, 4, 4], batch_size=2, num_workers=2,
                         pin_memory=False, persistent_workers=True, prefetch_factor=3)
    train, val, *_ = source.load()
    assert source.num_classes == 3 and train[0][0].shape == (1, 4, 4)
    loader = source.loader(train, list(range(len(train))), seed=0, on_gpu=False, train=True)
    assert isinstance(loader, DataLoader)
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers,
            loader.prefetch_factor) == (2, False, True, 3)
    assert sum(len(y) for _, y in loader) == len(train)
    # Defaults: pin memory only for a GPU; persistent workers for the training loader only.
    source = ImageFolder(root=str(tmp_path), shape=[1, 4, 4], batch_size=2, num_workers=1)
    val_loader = source.loader(val, [0, 1], seed=0, on_gpu=True, train=False)
    assert val_loader.pin_memory is True and val_loader.persistent_workers is False
    # The fast path: in-memory, no per-sample transform, fast_path on.
    syn = Synthetic(num_samples=10, val_samples=4, shape=[2], num_classes=2, batch_size=4)
    tr, *_ = syn.load()
    fast = syn.loader(tr, list(range(10)), seed=0, on_gpu=False, train=True)
    assert isinstance(fast, TensorLoader) and [len(y) for _, y in fast] == [4, 4, 2]
    syn.fast_path = False
    slow = syn.loader(tr, list(range(10)), seed=0, on_gpu=False, train=True)
    assert isinstance(slow, DataLoader)
    # Both give the same batches, in the sampler's order (here not the dataset's).
    order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]
    syn.fast_path = True
    fast_batches = list(syn.loader(tr, order, seed=0, on_gpu=False, train=True))
    syn.fast_path = False
    slow_batches = list(syn.loader(tr, order, seed=0, on_gpu=False, train=True))
    assert len(fast_batches) == len(slow_batches) == 3
    for (fx, fy), (sx, sy) in zip(fast_batches, slow_batches, strict=False):
        assert torch.equal(fx, sx) and torch.equal(fy, sy)
    assert torch.equal(fast_batches[0][1], tr.y[[7, 2, 9, 0]])


def test_missing_files_give_a_clear_message(workdir):
    """Through the CLI: one message naming the folder and the files, no traceback, exit 1."""
    res = run_cli_in_process(["data=mnist", "data.root=nowhere", *TINY], workdir, expect_ok=False)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    raw = workdir / "nowhere" / "MNIST" / "raw"
    assert f"missing from {raw}" in res.stderr and "train-images-idx3-ubyte" in res.stderr
    assert "data.download=true" in res.stderr
    assert not (workdir / "nowhere").exists()  # nothing was fetched or created


@pytest.mark.parametrize("model,shape,strategy", [
    ("convnet", "[1,1,1]", "single"),
    ("convnet", "[3,5,9]", "dp"),
    ("mlp", "[2,3]", "single"),
    ("resnet18", "[1,8,8]", "single"),
])
def test_each_model_trains(workdir, model, shape, strategy):
    trained(workdir, [f"model={model}", "data=synthetic", "data.num_samples=16",
                      "data.val_samples=4", f"data.shape={shape}", "data.num_classes=3",
                      f"trainer.strategy={strategy}", *TINY])


USER_MODEL = '''
"""A user's own model, outside ddpexp."""
import math
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, shape, classes, width=8):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), width), nn.ReLU(),
                                 nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)
'''


@pytest.fixture
def user_model(workdir) -> dict:
    """A model module on PYTHONPATH (so spawned workers import it too) and a config dir whose
    ``model/tiny.yaml`` points at it and reads the data's shape and classes."""
    lib = workdir / "userlib"
    lib.mkdir()
    (lib / "tiny_user_model.py").write_text(USER_MODEL)
    (workdir / "myconf" / "model").mkdir(parents=True)
    (workdir / "myconf" / "model" / "tiny.yaml").write_text(
        "_target_: tiny_user_model.TinyNet\nshape: ${data.shape}\nclasses: ${data.num_classes}\nwidth: 5\n")
    path = os.pathsep.join(p for p in (str(lib), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_user_model_by_target(workdir, user_model):
    trained(workdir, ["--config-dir", "myconf", "model=tiny", *TINY], env=user_model)
    ckpt = torch.load(only_run_dir(workdir) / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["model"]["net.1.weight"].shape == (5, 64)  # digits: 1x8x8 -> width 5
    assert ckpt["model"]["net.3.weight"].shape == (10, 5)


@pytest.mark.slow
def test_user_model_ddp(workdir, user_model):
    metrics = trained(workdir, ["--config-dir", "myconf", "model=tiny", "trainer.procs=2",
                                "trainer.strategy=ddp", *TINY], env=user_model)
    assert metrics["world_size"] == 2


def test_non_module_target_is_refused(workdir):
    res = run_cli_in_process(["model._target_=builtins.dict", "~model.input_shape",
                              "~model.num_classes", "~model.channels", "~model.hidden",
                              "~model.dropout", *TINY], workdir, expect_ok=False)
    assert res.returncode != 0 and "not a torch.nn.Module" in res.stderr
    assert "Traceback" not in res.stderr
