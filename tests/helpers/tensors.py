"""Tensors compared, and a small model trained a few steps, for the unit tests."""

from __future__ import annotations

import torch


def assert_same_tensors(a, b, where: str) -> None:
    """``a`` and ``b`` have the same structure and every tensor in them is ``torch.equal``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_close_grads(a: list[dict], b: list[dict], rtol: float) -> None:
    """Each gradient of ``a`` within ``rtol`` of ``b``'s, relative to its own norm, or to
    1e-4 of the step's whole gradient norm where it is smaller than that (the GPT's key bias
    has a zero gradient, 1e-11 of rounding, that no two reduction orders agree on)."""
    assert len(a) == len(b) > 0
    for step_a, step_b in zip(a, b, strict=False):
        assert step_a.keys() == step_b.keys()
        total = torch.stack([g.norm() for g in step_b.values()]).norm()
        for name in step_a:
            x, y = step_a[name], step_b[name]
            err = (x - y).norm() / torch.maximum(y.norm(), 1e-4 * total).clamp_min(1e-30)
            assert err <= rtol, f"{name}: relative difference {err:.2e}"


def small_net() -> torch.nn.Module:
    """The same small classifier (with a BatchNorm, whose buffers an average must follow)
    every time it is built."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def train_steps(model: torch.nn.Module, steps: int, seed: int = 1, after_step=None) -> None:
    """``steps`` SGD steps of ``model`` on random batches drawn from ``seed``; ``after_step()``
    runs after each optimizer step (an average's update, a profiler's step)."""
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
