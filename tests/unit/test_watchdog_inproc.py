"""The stall watchdog's rule in this process: the ranks behind are named once the others have
waited long enough; no watchdog means a heartbeat that does nothing."""

from __future__ import annotations

from ddpexp.launch import watchdog as wd
from ddpexp.runtime import heartbeat as hb


def _beat(rank, count, phase, at, restart=0):
    return wd.Beat(rank=rank, count=count, step=3, phase=phase, time=at, pid=100 + rank,
                   restart=restart)


def test_find_stall_names_the_ranks_behind_once_the_others_waited_long_enough():
    now = 1000.0
    beats = [_beat(0, 10, hb.BACKWARD, now - 6), _beat(1, 9, hb.FORWARD, now - 6.5),
             _beat(2, 10, hb.BACKWARD, now - 7)]
    assert wd.find_stall(beats, now, stall_s=7) is None  # rank 0 arrived only 6 s ago
    stall = wd.find_stall(beats, now, stall_s=5)
    assert [b.rank for b in stall.stalled] == [1] and {b.rank for b in stall.waiting} == {0, 2}
    text = stall.describe(now, "run/ddpexp.log")
    assert "rank 1 (pid 101) stalled in forward at step 3: no progress for 6 s" in text
    assert "(ranks 0, 2 waited 6 s for it in backward" in text and "run/ddpexp.log" in text
    # All ranks level (a long validation everywhere) is work, not a stall.
    level = [_beat(0, 5, hb.VALIDATION, now - 100), _beat(1, 5, hb.VALIDATION, now - 100)]
    assert wd.find_stall(level, now, stall_s=5) is None
    # Done ranks and slots of an earlier restart round do not count.
    assert wd.find_stall([_beat(0, 9, hb.DONE, now - 100), _beat(1, 3, hb.DATA, now - 100)],
                         now, 5) is None
    old = [_beat(0, 50, hb.BACKWARD, now - 100, restart=0), _beat(1, 2, hb.SETUP, now - 100, restart=1),
           _beat(0, 2, hb.SETUP, now - 100, restart=1)]
    assert wd.find_stall(old, now, 5) is None


def test_no_watchdog_means_a_no_op_heartbeat(monkeypatch):
    monkeypatch.delenv(hb.ENV_SLOTS, raising=False)
    beat = hb.heartbeat_from_env(0)
    assert isinstance(beat, hb.NoHeartbeat)
    beat.mark(hb.FORWARD, 1)
    beat.close()
