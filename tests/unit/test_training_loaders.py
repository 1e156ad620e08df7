"""The loaders of one rank (training/loaders.py): shards, limits, overfitting, batches on
the device."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch.utils.data import Subset

from ddpexp.data import Synthetic
from ddpexp.data.base import InMemory
from ddpexp.runtime.dist import DistContext, derive_seed
from ddpexp.training import loaders


def data(batch_size=4, n=(10, 7, 3)):
    source = Synthetic(num_samples=n[0], val_samples=n[1], test_samples=n[2], batch_size=batch_size,
                       shape=[2], num_classes=2)
    return source, source.load()


def test_one_rank_sees_everything(trainer_config):
    source, ds = data()
    built = loaders.build(trainer_config(), DistContext(), source, ds, seed=3)
    assert built.batches_per_epoch == 3 and built.rank_train_samples == 10
    assert built.rank_seed == derive_seed(3, 0)
    assert built.test_ds is ds[2] and built.val_ds is ds[1]
    assert sum(len(x) for x, _ in built.val_loader) == 7
    assert sorted(built.train_sampler) == list(range(10))


def test_second_rank_of_three_gets_unpadded_val_shard(trainer_config):
    source, ds = data()
    ctx = DistContext(rank=1, world_size=3)
    built = loaders.build(trainer_config(), ctx, source, ds, seed=0)
    val = torch.cat([y for _, y in built.val_loader])
    assert torch.equal(val, ds[1].y[[1, 4]])
    assert len(built.train_sampler) == 4  # ceil(10 / 3), padded for training
    # ... and the padding is not trained on: positions 1, 4, 7 of the epoch's 10 are rank 1's
    assert built.rank_train_samples == 3 and built.batches_per_epoch == 1
    assert built.epoch_samples == 10


def test_limit_train_and_val_batches(trainer_config):
    source, ds = data(batch_size=2)
    built = loaders.build(trainer_config(limit_train_batches=2, limit_val_batches=1), DistContext(),
                          source, ds, seed=0)
    assert built.batches_per_epoch == 2 and built.rank_train_samples == 4
    assert isinstance(built.val_loader, loaders.FirstBatches) and len(built.val_loader) == 1
    assert [len(y) for _, y in built.val_loader] == [2]


def test_overfit_validates_on_trained_samples(trainer_config):
    source, ds = data(batch_size=3)
    built = loaders.build(trainer_config(overfit_batches=2), DistContext(), source, ds, seed=0)
    assert built.batches_per_epoch == 2
    assert isinstance(built.val_ds, Subset) and list(built.val_ds.indices) == list(range(6))
    assert list(built.train_sampler)[:6] == list(range(6))  # unshuffled


def test_no_test_split(trainer_config):
    source, ds = data(n=(4, 2, 0))
    assert len(ds) == 2
    assert loaders.build(trainer_config(), DistContext(), source, ds, seed=0).test_ds is None


def test_first_batches_repeats_each_pass():
    fb = loaders.FirstBatches([1, 2, 3, 4], 2)
    assert list(fb) == [1, 2] and list(fb) == [1, 2] and len(fb) == 2
    assert len(loaders.FirstBatches([1], 5)) == 1


def test_to_device_keeps_nesting():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.zeros(1), (torch.ones(2), 3)], "p": Pair(torch.zeros(1), "s")}
    out = loaders.to_device(batch, torch.device("cpu"), torch.preserve_format)
    assert type(out["p"]) is Pair and out["p"].y == "s"
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple) and out["a"][1][1] == 3
    assert torch.equal(out["a"][1][0], torch.ones(2))


def test_to_device_channels_last_only_4d_floats():
    img, ints, vec = torch.randn(2, 3, 4, 5), torch.zeros(2, 3, 4, 5, dtype=torch.long), torch.randn(2, 3)
    a, b, c = loaders.to_device((img, ints, vec), torch.device("cpu"), torch.channels_last)
    assert a.is_contiguous(memory_format=torch.channels_last) and not a.is_contiguous()
    assert b.is_contiguous() and c.is_contiguous()
    assert torch.equal(a, img)


def test_eval_loader_of_dataloader_path(trainer_config):
    source = Synthetic(num_samples=4, val_samples=5, test_samples=0, batch_size=2, shape=[2],
                       num_classes=2)
    ds = InMemory(torch.arange(10.0).reshape(5, 2), torch.arange(5), transform=lambda x: x * 2)
    loader = loaders.eval_loader(trainer_config(), DistContext(rank=0, world_size=2), source, ds, 0)
    ys = torch.cat([y for _, y in loader])
    assert ys.tolist() == [0, 2, 4]
    xs = torch.cat([x for x, _ in loader])
    assert xs[1].tolist() == [8.0, 10.0]
