"""A user model (plugged in by ``_target_``) that misbehaves on one rank, to test that a
failing worker ends the whole run: it raises, kills itself, or stalls at a chosen step."""

from __future__ import annotations

import os
import signal
import time

from torch import nn

from ddpexp.models import MLP


class Faulty(nn.Module):
    """An MLP whose ``rank`` fails on its ``at_call``-th training forward."""

    def __init__(self, input_shape, num_classes, mode: str = "raise", rank: int = 1,
                 at_call: int = 3, first_attempt_only: bool = False, **mlp_kwargs):
        super().__init__()
        self.net = MLP(input_shape, num_classes, **mlp_kwargs)
        self.mode, self.rank, self.at_call = mode, rank, at_call
        self.first_attempt_only = first_attempt_only
        self.calls = 0

    def _should_fail(self) -> bool:
        if int(os.environ.get("RANK", 0)) != self.rank or self.calls != self.at_call:
            return False
        return not self.first_attempt_only or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self._should_fail():
                if self.mode == "raise":
                    raise RuntimeError(f"injected failure on rank {self.rank}")
                if self.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.mode == "stall":
                    time.sleep(3600)
        return self.net(x)


class TupleOut(nn.Module):
    """A model whose forward returns a tuple (logits, features), as some users' models do."""

    def __init__(self, input_shape, num_classes, **mlp_kwargs):
        super().__init__()
        self.net = MLP(input_shape, num_classes, **mlp_kwargs)

    def forward(self, x):
        out = self.net(x)
        return out, x


class NoParams(nn.Module):
    """A "model" with nothing to train."""

    def __init__(self, input_shape, num_classes, **kwargs):
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x):
        return x.flatten(1)[:, : self.num_classes]


class Unused(nn.Module):
    """An MLP with a layer its forward never uses: DDP needs find_unused_parameters."""

    def __init__(self, input_shape, num_classes, **mlp_kwargs):
        super().__init__()
        self.net = MLP(input_shape, num_classes, **mlp_kwargs)
        self.spare = nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)
