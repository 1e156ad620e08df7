"""The step profiler behind trainer.profile_steps and debug=profile (callbacks/profiler.py):
a Chrome trace of the profiled steps and the top operators in the log."""

from __future__ import annotations

import json
import logging

import torch
from torch import nn

from ddpexp.callbacks.profiler import StepProfiler


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, steps: int, seed: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_profiler_writes_a_chrome_trace_and_logs_top_operators(tmp_path, caplog):
    model = _net()
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
        _train_steps_with(prof, _net(), 1)
        prof.close()
    assert "no trace written" in caplog.text
    assert not prof.trace_path.exists()


def _train_steps_with(prof: StepProfiler, model: nn.Module, steps: int) -> None:
    for i in range(steps):
        _train(model, 1, seed=i)
        prof.step()
