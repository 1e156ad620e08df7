"""Checkpoint files: written atomically with their digests (:mod:`.files`), fsdp's sharded
directories (:mod:`.sharded`), read with ``weights_only=True`` and found for ``resume=``
(:mod:`.io`), numpy values in a callback's state kept readable that way (:mod:`.portable`),
which files ``trainer.save_top_k`` keeps (:mod:`.topk`), and ``trainer.async_save``'s copy and
background write (:mod:`.background`). What a checkpoint holds, and how a trainer is
restored from it, is :mod:`ddpexp.training.checkpoint_state`, next to the trainer it reads;
the callback that decides when to save is :mod:`ddpexp.callbacks.checkpoint`. This package
imports no other ddpexp package but the floors, so that the strategies, the callbacks and the
loop all stand on it."""
