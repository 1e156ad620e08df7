"""What callbacks and the other parts of a run see of the trainer (the surface
:class:`ddpexp.callbacks.base.TrainerView` documents): the counters, where this process is,
logging, stop requests and the agreement points, the weights' check and the checkpoint save.
:class:`~ddpexp.training.trainer.Trainer` is built on it; the loop itself is there."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ddpexp.callbacks.checkpoint import ModelCheckpoint
from ddpexp.runtime.heartbeat import CHECKPOINT
from ddpexp.training import checkpoint_state as schema

if TYPE_CHECKING:
    from torch import nn

    from ddpexp.callbacks.base import Dispatch
    from ddpexp.callbacks.state import RunState
    from ddpexp.checkpoint.background import Saver
    from ddpexp.config.schema import TrainerConfig
    from ddpexp.loggers.collection import Loggers
    from ddpexp.runtime.dist import DistContext
    from ddpexp.runtime.heartbeat import Heartbeat, NoHeartbeat
    from ddpexp.strategies.base import Strategy
    from ddpexp.training.agreement import Agreement
    from ddpexp.training.divergence import Divergence
    from ddpexp.training.meters import RunningMeans


class CallbackSurface:
    """The trainer's public surface; the counters are read-only views of ``self.state``,
    which only the trainer changes."""

    t: TrainerConfig
    ctx: DistContext
    state: RunState
    callbacks: Dispatch
    loggers: Loggers
    agreement: Agreement
    divergence: Divergence
    beat: Heartbeat | NoHeartbeat
    strategy: Strategy
    module: nn.Module
    saver: Saver
    train_means: RunningMeans
    _stepping: int

    @property
    def epoch(self) -> int:
        """The epoch being trained (0-based)."""
        return self.state.epoch

    @property
    def step(self) -> int:
        """Optimizer steps done in all."""
        return self.state.step

    @property
    def batch(self) -> int:
        """Micro-batches of the current epoch done on this rank."""
        return self.state.batch

    @property
    def status(self) -> str:
        """``running``, or how the run ended (``metrics.json``'s ``status``)."""
        return self.state.status

    @property
    def improved(self) -> bool:
        """Whether the latest validation was the best so far (``trainer.monitor``)."""
        return self.state.best.improved

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The run's :class:`~ddpexp.callbacks.ModelCheckpoint` (the one that owns the
        checkpoints dir and ``best.pt``), or None where ``~callbacks.checkpoint`` removed it."""
        return next((cb for _, cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send ``metrics`` to every logger at ``step`` (default: the current step; in
        ``on_before_optimizer_step``, the step being taken, as the built-in metrics of that
        optimizer step). Rank 0 writes; on the other ranks this is a no-op."""
        if step is None:
            # In on_before_optimizer_step, the step about to be counted: the one the built-in
            # metrics of that optimizer step are logged at.
            step = self.step + self._stepping
        self.loggers.log_metrics(metrics, step, self.epoch)

    def request_stop(self, reason: str, status: str = "stopped") -> None:
        """Ask for the run to end (from any rank, any event). All ranks stop together at the
        next agreement point (a log step, or the end of the epoch for a request made during
        its validation or epoch end, after that epoch's checkpoint); the run ends with
        ``status`` and ``reason`` in the log and ``metrics.json``."""
        self.agreement.request(reason, status)

    def agree(self) -> None:
        """An agreement point: every rank learns of the stops and divergences any rank saw.
        A collective: every rank must call it at the same point."""
        self._reduce()

    @property
    def stopping(self) -> bool:
        """Whether a stop signal reached the run (all ranks agreed on it)."""
        return self.agreement.interrupted

    @property
    def diverged(self) -> bool:
        """Whether the ranks agreed that training diverged (see :attr:`divergence`)."""
        return bool(self.divergence)

    def leaving_epoch(self) -> bool:
        """Whether the loop leaves the epoch after this step (a stop, a divergence, the last
        step)."""
        return self.agreement.stopping or self.diverged or self._steps_done()

    def weights_finite(self) -> bool:
        """Whether every weight is finite, the same verdict on every rank (a collective
        under fsdp: every rank must call it); where not, the run counts as diverged at this
        step. A checkpoint is written only after it says yes."""
        self.beat.mark(CHECKPOINT, self.step)
        if self.strategy.all_finite(self.module):
            return True
        self.divergence.note(self.step, self.epoch)
        return False

    def save_checkpoint(self, last: Path, copies: Sequence[Path] = (),
                        then: Callable[[], None] | None = None) -> None:
        """Write the checkpoint as of now (:mod:`ddpexp.training.checkpoint_state`) to ``last`` and
        copy it to each of ``copies`` (best.pt, a top-k file), then call ``then``: global
        rank 0 writes, or under fsdp every rank its shards of ``last``. Every rank must call
        it (it gathers each rank's random state). Under ``trainer.async_save`` the state is
        copied here and written in the background (:mod:`ddpexp.checkpoint.background`);
        the previous save is waited for first, and a failure of it raised."""
        self.beat.mark(CHECKPOINT, self.step)
        self.saver.wait()
        checkpoint = schema.gather(cast("schema.Checkpointable", self))  # the Trainer built on it
        self.state.last_saved_step = self.step
        copies = list(copies)
        strategy = self.strategy
        if strategy.staged_save:  # every rank writes (fsdp)
            self.saver.save_staged(
                lambda state, hook, staging: strategy.start_save(state, last, copies, hook,
                                                                 staging),
                lambda state: strategy.save(state, last, copies), checkpoint, then,
                agree=strategy.agree, peers=self.ctx.local_world_size)
        else:
            self.saver.save(lambda state: strategy.save(state, last, copies), checkpoint, then)

    def wait_for_saves(self) -> None:
        """Return once the checkpoint being written in the background (if any) is on disk;
        raise its failure."""
        self.saver.wait()


    def _reduce(self, *values: torch.Tensor | float) -> list[float]:
        """Sum scalars over all ranks in one collective, which is also where the ranks agree
        on stops and divergence (:mod:`ddpexp.training.agreement`)."""
        return self.agreement.reduce(values, self.train_means, self.step, self.epoch)

    def _steps_done(self) -> bool:
        return self.t.max_steps is not None and self.step >= self.t.max_steps
