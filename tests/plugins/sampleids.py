"""A user callback (``+callbacks.ids._target_=sampleids.SampleIds``) that records which
samples each rank trained on at each optimizer step: the data's first input feature holds
the sample's id (``helpers.files.write_shards``), read off the model's input in training
mode. One JSON line per step and rank, ``{"epoch", "step", "ids"}``, flushed as it is
written, in ``ids.rank<r>.jsonl`` of the run dir, so that a killed run's steps stay."""

from __future__ import annotations

import json

from ddpexp import Callback

ID_SCALE = 1024.0


class SampleIds(Callback):
    def __init__(self, name: str = "ids"):
        self.name = name
        self.pending: list[int] = []
        self.file = None

    def setup(self, trainer) -> None:
        def record(module, args) -> None:
            if module.training:
                self.pending.extend((args[0][:, 0] * ID_SCALE).round().long().tolist())

        trainer.module.register_forward_pre_hook(record)
        path = trainer.run_dir / f"{self.name}.rank{trainer.rank}.jsonl"
        self.file = path.open("a")

    def on_train_batch_end(self, trainer) -> None:
        assert self.file is not None
        self.file.write(json.dumps({"epoch": trainer.epoch, "step": trainer.step,
                                    "ids": self.pending}) + "\n")
        self.file.flush()
        self.pending = []

    def on_fit_end(self, trainer, result) -> None:
        if self.file is not None:
            self.file.close()
