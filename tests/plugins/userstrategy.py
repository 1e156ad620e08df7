"""A user's own strategy, as one is written in a user's package: DDP that counts its
wraps and leaves a marker per rank in the run dir, named by dotted path or ``_target_``
(``trainer.strategy=userstrategy.CountingDDP``)."""

from __future__ import annotations

import json
import os

from torch import nn

from ddpexp.strategies import DDP


class CountingDDP(DDP):
    """DDP whose every rank writes ``strategy-rank<R>.json``: its class, how many models it
    wrapped, and its data-parallel rank and size."""

    wraps = 0

    def __init__(self, t, ctx, note: str = ""):
        super().__init__(t, ctx)
        self.note = note

    def wrap(self, module: nn.Module) -> nn.Module:
        type(self).wraps += 1
        wrapped = super().wrap(module)
        run_dir = os.environ.get("USERSTRATEGY_DIR", ".")
        with open(os.path.join(run_dir, f"strategy-rank{self.ctx.rank}.json"), "w") as f:
            json.dump({"cls": type(self).__qualname__, "wraps": type(self).wraps,
                       "wrapped": type(wrapped).__name__, "dp_rank": self.dp_rank,
                       "dp_size": self.dp_size, "note": self.note}, f)
        return wrapped


class NotAStrategy:
    """A class that is no strategy, for the refusal's message."""
