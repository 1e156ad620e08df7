"""A user's own model with a tensor-parallel plan and no ddpexp code: a normed two-layer
classifier whose hidden layer is split by its outputs and whose output layer by its inputs."""

from __future__ import annotations

import math

from torch import nn


class Planned(nn.Module):
    def __init__(self, input_shape, num_classes: int, hidden=(32,), dropout: float = 0.0):
        super().__init__()
        width, features = int(list(hidden)[0]), math.prod(input_shape)
        self.norm = nn.LayerNorm(features)  # kept whole on every rank: not in the plan
        self.up, self.act, self.down = nn.Linear(features, width), nn.ReLU(), nn.Linear(width, num_classes)

    def forward(self, x):
        return self.down(self.act(self.up(self.norm(x.flatten(1)))))

    def ddpexp_tp_plan(self, tp: int) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
