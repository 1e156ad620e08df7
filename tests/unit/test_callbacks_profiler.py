"""The step profiler behind trainer.profile_steps and debug=profile (callbacks/profiler.py):
a Chrome trace of the profiled steps and the top operators in the log."""

from __future__ import annotations

import json
import logging

from helpers.tensors import small_net, train_steps
from torch import nn

from ddpexp.callbacks.profiler import StepProfiler


def _train(model: nn.Module, steps: int, seed: int = 1) -> None:
    train_steps(model, steps, seed)


def test_profiler_writes_a_chrome_trace_and_logs_top_operators(tmp_path, caplog):
    model = small_net()
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        prof = StepProfiler(steps=2, run_dir=tmp_path, skip=2)
        _train_steps_with(prof, model, 6)
        prof.close()
    trace = json.loads(prof.trace_path.read_text())
    assert prof.trace_path == tmp_path / "profile" / "trace.json"
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names  # the Linear layers' matmuls were recorded
    assert prof.table and "aten::" in prof.table
    assert "top operators by self cpu time total" in caplog.text


def test_profiler_run_too_short_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        prof = StepProfiler(steps=3, run_dir=tmp_path, skip=4)
        _train_steps_with(prof, small_net(), 1)
        prof.close()
    assert "no trace written" in caplog.text
    assert not prof.trace_path.exists()


def _train_steps_with(prof: StepProfiler, model: nn.Module, steps: int) -> None:
    for i in range(steps):
        _train(model, 1, seed=i)
        prof.step()
