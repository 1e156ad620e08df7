"""``data=synthetic`` builds its samples in place and gives exactly the textbook formula's samples
(its peak memory, measured in a fresh process: tests/e2e/test_peak_memory.py)."""

from __future__ import annotations

import torch

from ddpexp.data import Synthetic


def test_synthetic_samples_are_prototype_plus_noise() -> None:
    """The in-place build gives exactly the samples of the textbook formula, same seed."""
    splits = Synthetic(num_samples=9000, val_samples=64, test_samples=5, shape=[2, 3, 3],
                       num_classes=4, noise=0.5, data_seed=3).load()
    g = torch.Generator().manual_seed(3)
    prototypes = torch.randn((4, 2, 3, 3), generator=g)
    assert len(splits) == 3
    for split, n in zip(splits, (9000, 64, 5), strict=False):
        y = torch.randint(0, 4, (n,), generator=g)
        x = prototypes[y] + 0.5 * torch.randn((n, 2, 3, 3), generator=g)
        assert torch.equal(split.y, y) and torch.equal(split.x, x)
        assert split.x.dtype == torch.float32
