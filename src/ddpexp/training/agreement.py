"""What the ranks of a run decide together: whether to stop (a signal, a callback's
``request_stop``) and whether training diverged.

No rank may leave a collective the others are in, so no rank acts on what it alone saw.
What each rank saw rides along the one all-reduce that the loop runs anyway (at log steps,
at the end of each validation, and once at each epoch's end), and every rank then acts on
the same sum. One process has nobody to agree with and acts at once.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from ddpexp.runtime.signals import StopRequested
from ddpexp.training.divergence import Divergence
from ddpexp.training.meters import RunningMeans

# What a callback's request_stop(status=...) may end a run as, in the order that wins when
# ranks ask for different ones at once.
STOP_STATUSES = ("pruned", "early_stopped", "stopped")


class Agreement:
    """This rank's side of the decisions, and what all ranks agreed on so far."""

    def __init__(self, rank: int, world_size: int, device: torch.device, divergence: Divergence,
                 counts: bool = True):
        self.rank, self.world_size, self.device = rank, world_size, device
        # Whether this rank's sums count (DistContext.counts_samples): the other ranks of a
        # model-parallel group hold the same samples and add zeros, so each counts once.
        self.counts = counts
        self.divergence = divergence
        self.signal = StopRequested()  # the stop signals this process received
        self.interrupted = False  # a stop signal that all ranks agreed on
        self.requested: tuple[str, str] | None = None  # this rank's (status, reason)
        self.status: str | None = None  # a requested stop that all ranks agreed on
        self.reason: str | None = None  # why, with the asking ranks

    def request(self, reason: str, status: str) -> None:
        """This rank asks for the run to end as ``status``; the first request stands."""
        if status not in STOP_STATUSES:
            raise ValueError(f"status {status!r} is not one of {', '.join(STOP_STATUSES)}")
        if self.requested is None:
            self.requested = (status, str(reason))

    def reduce(self, values: tuple, meter: RunningMeans, step: int, epoch: int) -> list[float]:
        """Sum ``values`` (scalars or 1-d tensors) over all ranks in one collective, with this
        rank's stop flags and the training metrics ``meter`` holds not yet logged (their
        non-finite count and loss): every rank learns the same stops and divergence."""
        pending = meter.pending()
        nonfinite = (~torch.isfinite(pending)).sum()
        # Sums exist only once the names are fixed.
        loss = pending[cast(list, meter.names).index("loss")] if meter.sums is not None else 0.0
        asked = [float(self.requested is not None and self.requested[0] == s) for s in STOP_STATUSES]
        counted = (*values, nonfinite, loss, meter.seen)
        parts = [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(-1)
                 for v in (*counted, float(bool(self.signal)), *asked)]
        if not self.counts:
            parts[:len(counted)] = [torch.zeros_like(p) for p in parts[:len(counted)]]
        stats = torch.cat(parts)
        if self.world_size > 1:
            dist.all_reduce(stats)
        reduced = stats.tolist()
        *sums, nonfinite_count, loss_sum, seen, signal = reduced[:-len(STOP_STATUSES)]
        requested = reduced[-len(STOP_STATUSES):]
        if signal:
            self.interrupted = True
        if any(requested) and self.status is None:
            self._agree_stop(next(s for s, n in zip(STOP_STATUSES, requested, strict=True) if n))
        own = meter.value("loss") if nonfinite_count else None  # a host sync, once
        self.divergence.check(nonfinite_count, loss_sum, seen, own, step, epoch)
        return sums

    def alone(self) -> None:
        """One process: act on a signal or a request at once."""
        if self.signal:
            self.interrupted = True
        if self.requested is not None and self.status is None:
            self._agree_stop(self.requested[0])

    def _agree_stop(self, status: str) -> None:
        """Every rank knows that a stop was asked (as ``status``); all learn why."""
        mine = self.requested[1] if self.requested else None
        reasons = [mine]
        if self.world_size > 1:  # once per run, and every rank is here
            reasons: list[str | None] = [None] * self.world_size
            dist.all_gather_object(reasons, mine)
            reasons = [f"rank {r}: {text}" if text else None for r, text in enumerate(reasons)]
        self.status = status
        self.reason = "; ".join(r for r in reasons if r)

    @property
    def stopping(self) -> bool:
        """Whether the loop is to leave the epoch for a stop all ranks agreed on."""
        return self.interrupted or self.status is not None
