"""The elastic data stream in process: the sampler deals one global order out to any number
of ranks, each sample of an epoch trained on once (its padding marked), and a sample's random
draws are a function of (seed, epoch, index), not of the process that makes it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddpexp.data.base import EpochKeys, ResumableDistributedSampler, SeededSamples
from ddpexp.training.loaders import first_samples


def dealt(n: int, ranks: int, batch: int, epoch: int = 1, skip_batches: int = 0) -> list[int]:
    """The global order the ranks' real samples make, step by step (rank r's i-th sample of a
    step is the step's sample i * ranks + r)."""
    streams = []
    for r in range(ranks):
        s = ResumableDistributedSampler(range(n), num_replicas=ranks, rank=r, seed=5)
        s.set_epoch(epoch, skip=skip_batches * batch)
        real = s.real_samples - skip_batches * batch
        streams.append(list(s)[:max(0, real)])
    out = []
    for start in range(0, max(len(x) for x in streams), batch):
        parts = [x[start:start + batch] for x in streams]
        out += [p[i] for i in range(batch) for p in parts if i < len(p)]
    return out


@pytest.mark.parametrize("n", [96, 97, 99, 101, 5])
def test_every_world_size_trains_on_one_order_each_sample_once(n):
    """At 1 to 4 ranks of a global batch of 12 (and a resume part-way at another one), the
    real samples are the epoch's order, each once; the padding is only what makes ranks equal."""
    whole = dealt(n, 1, 12)
    assert sorted(whole) == list(range(n))
    for ranks in (2, 3, 4):
        assert dealt(n, ranks, 12 // ranks) == whole
        streams = [ResumableDistributedSampler(range(n), num_replicas=ranks, rank=r, seed=5)
                   for r in range(ranks)]
        assert {len(s) for s in streams} == {-(-n // ranks)}  # equal lengths: ranks step alike
        assert sum(s.real_samples for s in streams) == n
    # Killed after 2 steps of 12 at 4 ranks, resumed at 3: the rest of the same order.
    assert whole[:24] + dealt(n, 3, 4, skip_batches=2) == whole


def test_a_dataset_with_its_own_epoch_order_is_dealt_out_by_it():
    class Blocks(Dataset):
        def __len__(self):
            return 10

        def epoch_order(self, seed, epoch):
            return np.roll(np.arange(10), seed + epoch)

    s = ResumableDistributedSampler(Blocks(), num_replicas=2, rank=1, seed=1)
    s.set_epoch(2)
    assert list(s) == [8, 0, 2, 4, 6]


class Noisy(Dataset):
    """A sample is its index plus a draw of each generator, as a random augmentation makes."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random()])


def test_a_samples_draws_are_its_own_in_any_process():
    sampler = ResumableDistributedSampler(Noisy(), num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(4)
    seeded = SeededSamples(Noisy(), seed=3)

    def batches(workers: int) -> torch.Tensor:
        loader = DataLoader(seeded, batch_size=4, sampler=EpochKeys(sampler), num_workers=workers,
                            generator=torch.Generator().manual_seed(workers))  # as the trainer's
        return torch.cat(list(loader))

    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    here = batches(0)
    assert torch.equal(torch.rand(3), before)  # the training process's stream untouched
    assert torch.equal(here, batches(2))
    assert len(set(here[:, 1].tolist())) == 16  # the draws differ from sample to sample
    again = dict(zip(here[:, 0].tolist(), here[:, 1:].tolist(), strict=True))
    sampler.set_epoch(4, skip=8)  # part-way through: the rest draws the same
    rest = batches(1)
    assert all(again[row[0]] == row[1:] for row in rest.tolist())
    sampler.set_epoch(5)
    assert not torch.equal(batches(0)[:, 1].sort().values, here[:, 1].sort().values)


def test_first_samples_cut_every_tensor_of_the_batch():
    batch = {"x": torch.arange(10).view(5, 2), "y": (torch.arange(5), torch.tensor(3.0))}
    cut = first_samples(batch, 2, 5)
    assert cut["x"].shape == (2, 2) and torch.equal(cut["y"][0], torch.arange(2))
    assert cut["y"][1].item() == 3.0


def test_the_last_step_of_an_uneven_epoch_weights_each_sample_once():
    """99 samples at 2 ranks of 8: the last step holds 3, so each rank's loss is weighted
    against 1.5 (rank 0's 2 samples count 2/1.5, rank 1's one 1/1.5: the mean of all 3); 97
    samples leave rank 1 nothing at the last step: its batch of padding counts 0."""
    from ddpexp.training.loaders import mean_share, without_padding

    assert mean_share(99, 8, 2, 0, 1) == 8 and mean_share(99, 8, 2, 6, 7) == 1.5
    assert mean_share(96, 8, 2, 0, 6) == 48  # an optimizer step of 6 micro-batches
    batch = (torch.arange(8), torch.arange(8) * 2)
    cut, n = without_padding(batch, 1, 8, lambda b: len(b[0]))
    assert n == 1 and torch.equal(cut[1], torch.tensor([0]))
    assert without_padding(batch, 0, 8, lambda b: len(b[0]))[1] == 0
    # A batch whose count the cut does not change (its samples are not along dim 0) stays whole.
    assert without_padding(batch, 3, 8, lambda b: 8) == (batch, 8)
