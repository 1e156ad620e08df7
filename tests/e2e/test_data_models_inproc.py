"""Datasets in their real on-disk formats read in this process (idx, CIFAR-10's batches,
missing files named, nothing downloaded), the models at any input size, and the config
reference."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import write_cifar10, write_idx, write_mnist

CONF = Path(__file__).resolve().parents[2] / "src" / "ddpexp" / "conf"


# ---------------------------------------------------------------- datasets
def test_idx_reader_gzipped_and_plain(tmp_path):
    from ddpexp.data import read_idx

    a = np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5)
    write_idx(tmp_path / "plain", a, gz=False)
    write_idx(tmp_path / "zipped", a, gz=True)
    assert torch.equal(read_idx(tmp_path / "plain"), torch.from_numpy(a))
    assert torch.equal(read_idx(tmp_path / "zipped.gz"), torch.from_numpy(a))


def test_mnist_shape_mismatch_is_named(tmp_path):
    from ddpexp.data import MNIST
    from ddpexp.errors import ConfigError

    write_mnist(tmp_path, size=(12, 12))
    with pytest.raises(ConfigError, match=re.escape("set data.shape=[1,12,12]")):
        MNIST(root=str(tmp_path), shape=[1, 28, 28]).load()
    train, val, test = MNIST(root=str(tmp_path), shape=[1, 12, 12], mean=[0.5], std=[0.25]).load()
    # val: 10% of the 24 training images; test: the 8 of the test files.
    assert train.x.shape == (21, 1, 12, 12) and val.x.shape == (3, 1, 12, 12)
    assert test.x.shape == (8, 1, 12, 12)
    assert train.transform is None and -2.0 - 1e-6 <= train.x.min() and train.x.max() <= 2.0 + 1e-6


def test_cifar10_batches_are_not_unpickled_unsafely(tmp_path):
    from ddpexp.data import CIFAR10
    from ddpexp.errors import ConfigError

    folder = write_cifar10(tmp_path)
    # A pickle that would run a command when loaded by pickle.load.
    (folder / "test_batch").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(ConfigError, match="not a CIFAR-10 python batch.*os.system is not allowed"):
        CIFAR10(root=str(tmp_path), verify=False).load()


@pytest.mark.parametrize("name,hint", [
    ("FashionMNIST", "FashionMNIST/raw. Put train-images-idx3-ubyte"),
    ("CIFAR10", "cifar-10-batches-py. Put the python version's data_batch_1..5 and test_batch"),
    ("ImageFolder", "train does not exist. Lay the images out as"),
])
def test_missing_files_messages(tmp_path, name, hint):
    import ddpexp.data
    from ddpexp.errors import ConfigError

    source = getattr(ddpexp.data, name)(root=str(tmp_path / "none"), shape=[1, 4, 4])
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'none'}") + ".*" + re.escape(hint)):
        source.load()
    assert not (tmp_path / "none").exists()


def test_nothing_is_downloaded_by_default():
    from ddpexp.data.sources import _TorchvisionSource

    for name in ("mnist", "fashion_mnist", "cifar10"):
        assert yaml.safe_load((CONF / "data" / f"{name}.yaml").read_text())["download"] is False
    import inspect

    assert inspect.signature(_TorchvisionSource).parameters["download"].default is False


# ---------------------------------------------------------------- models
@pytest.mark.parametrize("shape", [[1, 1, 1], [3, 5, 9], [2, 17, 4]])
def test_convnet_any_size(shape):
    from ddpexp.models import ConvNet

    model = ConvNet(shape, num_classes=3, channels=[4, 8], hidden=8)
    x = torch.randn(2, *shape)
    loss = model(x).logsumexp(1).sum()
    loss.backward()
    assert model(x).shape == (2, 3)


@pytest.mark.parametrize("shape", [[1, 12, 12], [3, 8, 16], [3, 70, 64]])
def test_resnet18_small_inputs_and_channels(shape):
    from ddpexp.models import resnet18

    model = resnet18(shape, num_classes=4).eval()
    with torch.no_grad():
        assert model(torch.randn(1, *shape)).shape == (1, 4)


# ---------------------------------------------------------------- docs
def test_config_reference_lists_every_key():
    """docs/config.md names every option of every group and every key they and TrainerConfig
    have, so that the reference cannot fall behind the config."""
    import dataclasses

    from ddpexp.config.schema import TrainerConfig

    doc = (CONF.parents[2] / "docs" / "config.md").read_text()
    for f in dataclasses.fields(TrainerConfig):
        assert f"`trainer.{f.name}`" in doc, f.name
    for group in ("task", "model", "data", "optimizer", "scheduler"):
        for path in sorted((CONF / group).glob("*.yaml")):
            assert f"`{path.stem}`" in doc, f"{group}={path.stem}"
            node = yaml.safe_load(path.read_text()) or {}
            for key in node:
                if key in ("_target_", "_partial_", "defaults", "input_shape", "num_classes") \
                        and group != "data":
                    continue
                if key in ("_target_", "_partial_"):
                    continue
                assert f"`{key}`" in doc or f"`{group}.{key}`" in doc, f"{group}/{path.stem}: {key}"
            if "_target_" in node:
                assert node["_target_"].rsplit(".", 1)[-1] in doc, node["_target_"]
