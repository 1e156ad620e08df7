"""``callbacks.checkpoint``: ``last.pt`` at every epoch end (and every
``trainer.ckpt_every_steps`` steps, and when a signal stops the run), ``best.pt`` when the
monitored metric improved, and with ``save_top_k=K`` the K best epochs' files.

It runs last among the callbacks at each event, so a checkpoint holds the state that every
other callback reached in its epoch. Saving gathers every rank's random state (a collective
on every rank); global rank 0 writes, or under ``strategy=fsdp`` every rank writes its shards
of ``last.pt`` (a directory) and rank 0 writes best.pt and the top-k files, whole weights. Non-finite weights are never written: every rank holds
the same weights and reaches the same verdict, and the run then stops as diverged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ddpexp.checkpoint import io as ckpt_io
from ddpexp.callbacks.base import LAST, Callback
from ddpexp.errors import ConfigError
from ddpexp.training.signals import Interrupted
from ddpexp.checkpoint.topk import TopK
from ddpexp.launch.watchdog import CHECKPOINT

if TYPE_CHECKING:
    from ddpexp.training.trainer import Trainer


log = logging.getLogger("ddpexp")


class ModelCheckpoint(Callback):
    """Writes the run's checkpoints into ``run_dir/checkpoints``."""

    order = LAST

    def __init__(self, save_top_k: Optional[int] = None, every_n_steps: Optional[int] = None):
        for key, value in (("save_top_k", save_top_k), ("every_n_steps", every_n_steps)):
            if value is not None and int(value) < 1:
                raise ConfigError(f"callbacks.checkpoint.{key}={value} must be >= 1 (or null)")
        self.save_top_k, self.every_n_steps = save_top_k, every_n_steps
        self.top_k: Optional[TopK] = None

    def setup(self, trainer: Trainer) -> None:
        self.dir = trainer.run_dir / "checkpoints"
        if self.save_top_k:
            self.top_k = TopK(self.save_top_k, trainer.monitor, trainer.monitor_mode)

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.is_main:
            return
        removed = ckpt_io.remove_stale_temporaries(self.dir)
        if removed:
            log.info("removed %d stale checkpoint temporaries", len(removed))
        if self.top_k is not None and trainer.resumed:
            strays = self.top_k.reconcile(self.dir)
            if strays:
                log.warning("trainer.save_top_k: %s in %s are not in the resumed ranking and are "
                            "left alone", ", ".join(strays), self.dir)

    def on_train_batch_end(self, trainer: Trainer) -> None:
        every = self.every_n_steps
        # The epoch's last step is saved at its end, validated; leaving it early saves too.
        if not every or trainer.step % every or trainer.batch >= trainer.batches_per_epoch \
                or trainer.leaving_epoch():
            return
        trainer.agree()  # on divergence first: never checkpoint NaN weights
        if not trainer.diverged:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        ranked = (metrics[trainer.monitor], trainer.epoch) if self.top_k is not None else None
        self.save(trainer, best=trainer.improved, ranked=ranked)

    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        # A signal: every rank agreed on it, so every rank takes part in the save.
        if isinstance(exc, Interrupted) and trainer.last_saved_step != trainer.step:
            self.save(trainer)

    def save(self, trainer: Trainer, best: bool = False,
             ranked: Optional[tuple[float, int]] = None) -> None:
        """Every rank contributes its state; rank 0 writes last.pt (and best.pt, and the
        top-k file of a validation ``ranked`` = (value, epoch) that makes the top k). Files
        that fell out of the top k are deleted only once the new checkpoint is on disk."""
        trainer.beat.mark(CHECKPOINT, trainer.step)
        if not trainer.strategy.all_finite(trainer.module):
            trainer.divergence.note(trainer.step, trainer.epoch)
            return
        entry, dropped = None, []
        if self.top_k is not None and ranked is not None:
            entry, dropped = self.top_k.offer(*ranked)  # before the state, which holds it
        state = trainer.checkpoint_state()
        trainer.last_saved_step = trainer.step
        copies = ([self.dir / ckpt_io.BEST] if best else []) + ([self.dir / entry] if entry else [])
        trainer.strategy.save(state, self.dir / ckpt_io.LAST, copies)
        if trainer.is_main:
            for name in dropped:
                (self.dir / name).unlink(missing_ok=True)

    def state_dict(self) -> dict:
        return {"top_k": self.top_k.state_dict() if self.top_k is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.top_k is not None:
            self.top_k.load_state_dict(state.get("top_k"))
