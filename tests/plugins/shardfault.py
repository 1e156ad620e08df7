"""A user callback (``+callbacks.cut._target_=shardfault.CutShard``) that cuts the tar shard
``path`` to half its length after optimizer step ``at`` (rank 0), as a file changed under a
running job would be, so that a later read of it fails."""

from __future__ import annotations

import os

from ddpexp import Callback


class CutShard(Callback):
    def __init__(self, path: str, at: int = 2):
        self.path, self.at = path, int(at)

    def on_train_batch_end(self, trainer) -> None:
        if trainer.is_main and trainer.step == self.at:
            os.truncate(self.path, os.path.getsize(self.path) // 2)
