"""The run's counters where earlier versions documented them (``trainer.state``): they live
with the callbacks' seam, in :mod:`ddpexp.callbacks.state`."""

from ddpexp.callbacks.state import Best, RunState

__all__ = ["Best", "RunState"]
