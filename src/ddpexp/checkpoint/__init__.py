"""Checkpoints: files written atomically and read with ``weights_only=True`` (:mod:`.io`),
what a checkpoint holds and how a trainer is restored from it (:mod:`.state`), and which
files ``trainer.save_top_k`` keeps (:mod:`.topk`). The callback that decides when to save is
:mod:`ddpexp.callbacks.checkpoint`."""
