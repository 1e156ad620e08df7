"""A task's metric objects over a whole split (an F1, an AUROC, an R2: what is not a mean over
samples), kept on the device, fed batch by batch and computed once per evaluation.

Evaluation shards are unpadded, each sample on one rank, so the metrics are exact once the
ranks' states are joined: torchmetrics' ``compute()`` gathers them itself when a process
group is initialised. That is a collective, so every rank computes every metric, in the
same order, at the end of every evaluation; a run whose task has no metric objects runs
none of this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddpexp.errors import ConfigError
from ddpexp.training.meters import OUTPUTS

_METHODS = ("update", "compute", "reset")


class SplitMetrics:
    """The objects of ``task.split_metrics()`` by name, on ``device``."""

    def __init__(self, task: Any, device: torch.device, group: Any = None):
        self.task = task
        built = task.split_metrics() or {}
        name = type(task).__name__
        if not isinstance(built, Mapping):
            raise ConfigError(f"task {name}: split_metrics() must return a dict of metric "
                              f"objects by name; got {type(built).__name__}")
        for key, metric in built.items():
            missing = [m for m in _METHODS if not callable(getattr(metric, m, None))]
            if not isinstance(key, str) or missing:
                raise ConfigError(
                    f"task {name}: split_metrics()[{key!r}] is a {type(metric).__name__} "
                    f"without {', '.join(missing) or 'a string name'}; give metric objects "
                    "with update/compute/reset (a torchmetrics Metric) under string names"
                )
        self.metrics: dict[str, Any] = {
            k: m.to(device) if callable(getattr(m, "to", None)) else m for k, m in built.items()
        }
        if group is not None:
            # The ranks of one model-parallel group hold the same samples: a metric joins
            # the states of its data-parallel replicas only (DistContext.dp_group).
            for metric in self.metrics.values():
                if hasattr(metric, "process_group"):
                    metric.process_group = group

    def __bool__(self) -> bool:
        return bool(self.metrics)

    @property
    def names(self) -> list[str]:
        return list(self.metrics)

    def update(self, out: Mapping[str, Any], batch: Any) -> None:
        """Feed one batch: the task's ``update_metrics`` with ``out["outputs"]``."""
        self.task.update_metrics(self.metrics, out.get(OUTPUTS), batch)

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def compute(self, prefix: str) -> dict[str, float]:
        """``prefix/<name>`` of every metric over all ranks' samples (a collective under a
        process group: every rank must call it), then the metrics reset."""
        values = []
        for key, metric in self.metrics.items():
            value = torch.as_tensor(metric.compute())
            if value.numel() != 1:
                raise ConfigError(
                    f"task {type(self.task).__name__}: metric {key!r} computed a tensor of "
                    f"shape {list(value.shape)}; a logged metric must be one number (use "
                    "average='macro' or similar)"
                )
            values.append(value.reshape(()).double().cpu())
        self.reset()
        return {f"{prefix}/{k}": v for k, v in zip(self.metrics, torch.stack(values).tolist(), strict=True)}
