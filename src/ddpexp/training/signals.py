"""The stop signals' names where earlier versions documented them (a callback's
``on_exception`` receives :class:`Interrupted`): they live in :mod:`ddpexp.runtime.signals`."""

from ddpexp.runtime.signals import Interrupted, StopRequested, stop_signals

__all__ = ["Interrupted", "StopRequested", "stop_signals"]
