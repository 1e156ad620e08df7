"""Per-sample means of a task's metrics, kept on the device and reduced across ranks.

A task returns each metric as the mean over its batch's samples; :class:`RunningMeans` adds
``n`` times each value to per-name sums (float64, on the device: no host sync per step), so
that the sums of all ranks divided by the samples of all ranks give exactly the mean one big
batch would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ddpexp.errors import ConfigError

# The entry of a task step's dict that is not a metric: what the task's update_metrics feeds
# to its metric objects over a whole split (predictions, say). Never logged.
OUTPUTS = "outputs"


def metric_names(out: Any, task: str, method: str) -> list[str]:
    """The names of a task step's metrics, checked once: a dict of scalar tensors with
    ``loss`` among them (and, aside, perhaps an ``"outputs"`` entry of any kind)."""
    if not isinstance(out, Mapping) or "loss" not in out:
        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
        raise ConfigError(
            f"task {task}: {method} must return a dict of scalar tensors with a 'loss' entry; "
            f"got {got}"
        )
    bad = [k for k, v in out.items()
           if k != OUTPUTS and not (isinstance(v, torch.Tensor) and v.numel() == 1)]
    if bad:
        raise ConfigError(
            f"task {task}: {method} returned non-scalar values for {', '.join(map(str, bad))}; "
            "each entry must be the mean over the batch's samples (a scalar tensor)"
        )
    return [k for k in out if k != OUTPUTS]


class RunningMeans:
    """Sample-weighted sums of named metrics since the last :meth:`reset`."""

    def __init__(self, device: torch.device, names: Sequence[str] | None = None):
        self.device = device
        self.names: list[str] | None = list(names) if names is not None else None
        self.sums: torch.Tensor | None = None
        self.seen = 0
        if self.names is not None:
            self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)

    def add(self, out: Mapping[str, torch.Tensor], n: int, task: str = "", method: str = "") -> None:
        """Add ``n`` times each metric of ``out``; the first call fixes (and checks) the names."""
        if self.names is None:
            self.names = metric_names(out, task, method)
        if self.sums is None:
            self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        self.sums.add_(torch.stack([out[k].detach().double() for k in self.names]), alpha=n)
        self.seen += n

    def pending(self) -> torch.Tensor:
        """The sums (a zero-length tensor before the first :meth:`add`)."""
        return self.sums if self.sums is not None else torch.zeros(0, dtype=torch.float64,
                                                                   device=self.device)

    def reset(self) -> None:
        if self.sums is not None:
            self.sums.zero_()
        self.seen = 0

    def value(self, name: str) -> float | None:
        """This rank's pending sum of ``name`` (a host sync: off the hot path)."""
        if self.sums is None or not self.names or name not in self.names:
            return None
        return float(self.sums[self.names.index(name)])

    def state_dict(self) -> dict:
        return {"names": list(self.names or []),
                "sums": self.sums.tolist() if self.sums is not None else [], "seen": self.seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["names"]:
            self.names = list(state["names"])
            self.sums = torch.tensor(state["sums"], dtype=torch.float64, device=self.device)
        self.seen = int(state["seen"])


def means(names: Sequence[str], sums: Sequence[float], count: float, prefix: str,
          derived: Any = None) -> dict[str, float]:
    """``prefix/name`` -> sum / count for each name, plus what ``derived(means)`` adds."""
    values = {n: s / max(count, 1) for n, s in zip(names, sums, strict=True)}
    if derived is not None:
        values.update(derived(values))
    return {f"{prefix}/{n}": v for n, v in values.items()}
