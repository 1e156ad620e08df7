"""``trainer.strategy=dp``: ``nn.DataParallel`` over a node's GPUs, from one process."""

from __future__ import annotations

import torch
from torch import nn

from ddpexp.strategies.base import Local


class DataParallel(Local):
    """One process replicates the model over every GPU of ``trainer.gpus`` at each step; on
    the CPU or one GPU, the plain model."""

    name = "dp"
    one_process = True

    def wrap(self, module: nn.Module) -> nn.Module:
        if torch.cuda.device_count() > 1:
            return nn.DataParallel(module)
        return module
