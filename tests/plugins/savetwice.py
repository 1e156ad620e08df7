"""A user callback (``+callbacks.savetwice._target_=savetwice.SaveTwice``) for
``trainer.async_save`` with several workers (fsdp): at step ``at`` every rank saves
``checkpoints/sync.pt`` in the loop, then the same step as ``checkpoints/async.pt`` in the
background, whose write (in DCP's thread, on every rank) is held until the loop has taken
``more`` further steps; every later background write is held ``hold_s``. At the end of the
run each rank writes what it saw to ``report.<rank>.json`` in the run dir."""

from __future__ import annotations

import json
import threading
import time

import torch
from torch.distributed.tensor import DTensor

from ddpexp import Callback
from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import sharded as ckpt_sharded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SaveTwice(Callback):
    def __init__(self, at: int = 2, more: int = 2, hold_s: float = 0.3):
        self.at, self.more, self.hold_s = int(at), int(more), float(hold_s)
        self.release = threading.Event()
        self.holding = False
        self.busy_while_training: list[bool] = []
        self.moved = False
        self.held = 0  # background writes seen

    def setup(self, trainer) -> None:
        trainer.saver.before_write = self._hold

    def _hold(self) -> None:
        self.held += 1
        if self.holding:
            self.holding = False
            self.release.wait(timeout=120)
        else:
            time.sleep(self.hold_s)

    def on_train_batch_end(self, trainer) -> None:
        if trainer.step == self.at:
            out = trainer.run_dir / "checkpoints"
            mode = trainer.saver.mode
            trainer.saver.mode = False
            trainer.save_checkpoint(out / "sync.pt")
            trainer.saver.mode, self.holding = True, True
            trainer.save_checkpoint(out / "async.pt")
            trainer.saver.mode = mode
            self.saved = {k: _local(v).clone() for k, v in trainer.module.state_dict().items()}
        elif trainer.step > self.at:
            self.busy_while_training.append(trainer.saver.busy)
            if trainer.step == self.at + self.more:
                self.moved = any(not torch.equal(_local(v), self.saved[k])
                                 for k, v in trainer.module.state_dict().items())
                self.release.set()

    def on_fit_end(self, trainer, result) -> None:
        out = trainer.run_dir / "checkpoints"
        report = {"busy_while_training": self.busy_while_training, "moved": self.moved,
                  "held": self.held, "busy_at_end": trainer.saver.busy, "step": trainer.step}
        if trainer.is_main:  # rank 0 completes the sharded directory and renames it
            report["last_step"] = torch.load(out / ckpt_files.LAST / ckpt_sharded.META,
                                             weights_only=True)["step"]
            report["temporaries"] = sorted(p.name for p in out.iterdir() if ".tmp-" in p.name)
        (trainer.run_dir / f"report.{trainer.rank}.json").write_text(json.dumps(report))
