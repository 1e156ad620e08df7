"""Run modes: what a run's workers do with the trainer its spec builds.

A :class:`~ddpexp.config.spec.RunSpec` carries one mode, a small frozen dataclass of its own
settings: :class:`~ddpexp.modes.train.Train` (``python -m ddpexp``) or
:class:`~ddpexp.modes.evaluate.Evaluate` (``python -m ddpexp.eval``). Every worker builds the
trainer the same way and then calls ``spec.mode.run(trainer, spec)``; the worker knows no mode
by name. A new mode is a module here with such a class (``name``, ``run``, and ``from_dict``
where its fields are not plain JSON) and one line in :data:`ddpexp.config.modes.MODES`.

A mode reads the trainer through the methods it calls (:class:`~ddpexp.config.modes.Runnable`),
not by importing it: the spec that holds a mode is below the training code.
"""
