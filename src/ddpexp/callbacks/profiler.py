"""``callbacks.profiler``: torch.profiler over ``steps`` optimizer steps
(``trainer.profile_steps``, ``debug=profile``) on global rank 0, written to
``profile/trace.json`` (see :mod:`ddpexp.profiling`)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ddpexp.callbacks.base import Callback
from ddpexp.errors import ConfigError



class Profiler(Callback):
    """``steps=None`` leaves it off."""

    def __init__(self, steps: Optional[int] = None, skip: int = 2):
        if steps is not None and int(steps) < 1:
            raise ConfigError(f"trainer.profile_steps={steps} must be >= 1 (or null)")
        self.steps, self.skip = steps, skip
        self.enabled = steps is not None
        self.profiler: Any = None

    def on_fit_start(self, trainer: "Trainer") -> None:
        if trainer.is_main:
            from ddpexp.profiling import StepProfiler

            self.profiler = StepProfiler(int(self.steps), trainer.run_dir, trainer.device.type,
                                         skip=self.skip)

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_fit_end(self, trainer: "Trainer", result: Mapping[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: "Trainer", exc: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
