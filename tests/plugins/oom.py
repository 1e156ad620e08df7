"""A user's model that runs out of memory on global rank 1 alone above a batch size, as one
worker of a job whose GPUs differ would: ``torch.OutOfMemoryError`` in its forward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpexp.models import MLP


class OutOfMemoryAbove(MLP):
    def __init__(self, input_shape, num_classes, limit: int, hidden=(16,), dropout=0.0):
        super().__init__(input_shape, num_classes, hidden, dropout)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized() and dist.get_rank() == 1 \
                and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"rank 1: a batch of {x.shape[0]} does not fit "
                                         f"(the limit is {self.limit})")
        return super().forward(x)
