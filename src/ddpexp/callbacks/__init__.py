"""Callbacks: the loop's extension seam (see :mod:`ddpexp.callbacks.base`), the run's counters
a callback reads (:mod:`ddpexp.callbacks.state`) and the built-in features that act on its
events, each its own module, composed by the ``callbacks`` config group
(``conf/callbacks/default.yaml``)."""

from ddpexp.callbacks.base import EARLY, EVENTS, LAST, LATE, USER, Callback, Dispatch
from ddpexp.callbacks.checkpoint import ModelCheckpoint
from ddpexp.callbacks.early_stopping import EarlyStopping
from ddpexp.callbacks.ema import EMA
from ddpexp.callbacks.lr_monitor import LearningRateMonitor
from ddpexp.callbacks.memory import ModelStateSize
from ddpexp.callbacks.profiler import Profiler
from ddpexp.callbacks.progress import ProgressBar
from ddpexp.callbacks.pruning import OptunaPruning

__all__ = [
    "Callback", "Dispatch", "EVENTS", "EARLY", "USER", "LATE", "LAST",
    "ModelCheckpoint", "EarlyStopping", "EMA", "LearningRateMonitor", "Profiler",
    "ProgressBar", "OptunaPruning", "ModelStateSize",
]
