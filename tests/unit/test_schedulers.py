"""Learning-rate schedules, stepped once per optimizer step (schedulers.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from ddpexp import schedulers
from ddpexp.errors import ConfigError


def opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs(sched, n):
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


def test_cosine_without_warmup():
    got = lrs(schedulers.cosine(opt(), total_steps=4, steps_per_epoch=2), 5)
    assert got == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])


def test_cosine_warmup_and_min_lr():
    got = lrs(schedulers.cosine(opt(2.0), total_steps=6, steps_per_epoch=3, warmup_steps=2,
                                min_lr=0.2), 7)
    assert got[:2] == pytest.approx([1.0, 2.0])
    assert got[2] == pytest.approx(2.0) and got[-1] == pytest.approx(0.2)


def test_warmup_longer_than_run_shrinks(caplog):
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        s = schedulers.cosine(opt(), total_steps=3, steps_per_epoch=3, warmup_steps=10)
    assert "scheduler.warmup_steps=10 is not below this run's 3 optimizer steps: warming up over 2" in caplog.text
    assert lrs(s, 2) == pytest.approx([0.5, 1.0])


def test_negative_warmup():
    with pytest.raises(ConfigError, match="scheduler.warmup_steps=-1 must be >= 0"):
        schedulers.cosine(opt(), total_steps=3, steps_per_epoch=1, warmup_steps=-1)


def test_step_decays_per_epoch():
    got = lrs(schedulers.step(opt(), total_steps=8, steps_per_epoch=2, step_size=2, gamma=0.5), 8)
    assert got == pytest.approx([1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5])


def test_step_size_must_be_positive():
    with pytest.raises(ConfigError, match="scheduler.step_size=0 must be >= 1"):
        schedulers.step(opt(), total_steps=8, steps_per_epoch=2, step_size=0)


def test_onecycle_peaks_at_max_lr():
    got = lrs(schedulers.onecycle(opt(), total_steps=10, steps_per_epoch=5, max_lr=0.4,
                                  pct_start=0.5), 10)
    assert got[0] == pytest.approx(0.4 / 25)
    assert max(got) == pytest.approx(0.4, rel=1e-3)


def test_schedule_state_is_weights_only_safe(tmp_path):
    s = schedulers.step(opt(), total_steps=8, steps_per_epoch=2)
    lrs(s, 3)
    torch.save(s.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["last_epoch"] == 3
