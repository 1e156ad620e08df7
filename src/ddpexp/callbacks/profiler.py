"""``callbacks.profiler``: torch.profiler over ``steps`` optimizer steps
(``trainer.profile_steps``, ``debug=profile``) on global rank 0, written to
``profile/trace.json``.

The first steps of a run pay one-off costs (allocator growth, lazy initialisation, autotuning)
that would dominate a profile of a few steps, so :class:`StepProfiler` skips ``skip`` steps
(the last of them warms the profiler up) and then records ``steps`` steps. When the window
ends it writes a Chrome trace (``profile/trace.json`` in the run dir; open it in
https://ui.perfetto.dev or chrome://tracing) and logs the operators that took the most time.
Only global rank 0 profiles: the trace is one of the run's outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from ddpexp.callbacks.base import Callback, TrainerView
from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")

TRACE = Path("profile") / "trace.json"


class StepProfiler:
    """Call :meth:`step` after every optimizer step and :meth:`close` at the end of the run."""

    def __init__(self, steps: int, run_dir: Path, device_type: str = "cpu", skip: int = 2,
                 top: int = 15):
        from torch.profiler import ProfilerActivity, profile, schedule

        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        self.steps, self.skip, self.top = steps, max(1, skip), top
        self.trace_path = Path(run_dir) / TRACE
        self.on_gpu = device_type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        self.done = False
        self.table: str | None = None
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self.skip - 1, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=True,
        )
        self._prof.start()

    def step(self) -> None:
        """One optimizer step done; a no-op once the trace is written."""
        if not self.done:
            self._prof.step()

    def close(self) -> None:
        """Stop profiling. A run that ended inside the recording window still gets the trace
        of the steps recorded so far; one that ended before it says so."""
        if self.done:
            return
        self._prof.stop()
        if not self.done:
            self.done = True
            log.warning("trainer.profile_steps=%d: the run ended after fewer than %d steps, before "
                        "the profiler recorded any; no trace written", self.steps, self.skip)

    def _ready(self, prof: Any) -> None:
        self.done = True
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        sort_by = "self_device_time_total" if self.on_gpu else "self_cpu_time_total"
        self.table = prof.key_averages().table(sort_by=sort_by, row_limit=self.top)
        log.info("profile of %d step(s) after %d warm-up step(s): trace %s (open it in "
                 "https://ui.perfetto.dev)\ntop operators by %s:\n%s", self.steps, self.skip,
                 self.trace_path, sort_by.replace("_", " "), self.table)

class Profiler(Callback):
    """``steps=None`` leaves it off."""

    def __init__(self, steps: int | None = None, skip: int = 2):
        if steps is not None and int(steps) < 1:
            raise ConfigError(f"trainer.profile_steps={steps} must be >= 1 (or null)")
        self.steps, self.skip = steps, skip
        self.enabled = steps is not None
        self.profiler: Any = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.is_main:
            self.profiler = StepProfiler(int(cast(int, self.steps)), trainer.run_dir, trainer.device.type,
                                         skip=self.skip)

    def on_train_batch_end(self, trainer: TrainerView) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_fit_end(self, trainer: TrainerView, result: Mapping[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
