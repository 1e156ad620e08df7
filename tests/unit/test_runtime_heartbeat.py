"""A worker's heartbeat (runtime/heartbeat.py) where no watchdog listens."""

from __future__ import annotations

from ddpexp.runtime import heartbeat as hb


def test_heartbeat_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv(hb.ENV_SLOTS, raising=False)
    assert isinstance(hb.heartbeat_from_env(0), hb.NoHeartbeat)
    monkeypatch.setenv(hb.ENV_SLOTS, str(tmp_path / "missing"))
    assert isinstance(hb.heartbeat_from_env(0), hb.NoHeartbeat)
    hb.NoHeartbeat().mark(hb.DATA, 1)
