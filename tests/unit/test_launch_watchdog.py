"""The stall watchdog's pure parts (launch/watchdog.py): slots, beats, the stall rule and
its message, with a worker's heartbeat (runtime/heartbeat.py) writing the slots."""

from __future__ import annotations

import os

from ddpexp.launch import watchdog as w
from ddpexp.runtime import heartbeat as hb


def beat(rank, count, phase=hb.FORWARD, time=100.0, restart=0, step=5):
    return w.Beat(rank=rank, count=count, step=step, phase=phase, time=time, pid=1000 + rank,
                  restart=restart)


def test_phase_names():
    assert beat(0, 1, phase=hb.BACKWARD).phase_name == "backward"
    assert beat(0, 1, phase=42).phase_name == "phase 42"


def test_no_stall_when_in_step():
    beats = [beat(0, 10), beat(1, 10)]
    assert w.find_stall(beats, now=1000.0, stall_s=5) is None
    assert w.find_stall([], now=0, stall_s=1) is None
    assert w.find_stall([beat(0, 3)], now=1000.0, stall_s=1) is None


def test_stall_of_rank_behind():
    beats = [beat(0, 10, phase=hb.VALIDATION, time=100.0), beat(1, 7, time=90.0), beat(2, 10, time=99.0)]
    assert w.find_stall(beats, now=104.0, stall_s=5) is None  # waited 4 s only
    stall = w.find_stall(beats, now=110.0, stall_s=5)
    assert [b.rank for b in stall.stalled] == [1]
    assert [b.rank for b in stall.waiting] == [0, 2] and stall.waited_s == 10.0


def test_done_and_older_rounds_do_not_count():
    beats = [beat(0, 10), beat(1, 2, restart=0), beat(2, 3, restart=1), beat(3, 3, phase=hb.DONE, restart=1)]
    assert w.find_stall(beats, now=1e6, stall_s=1) is None


def test_describe_one_stalled():
    stall = w.Stall(stalled=[beat(1, 7, phase=hb.DATA, time=90.0, step=12)],
                    waiting=[beat(0, 10, phase=hb.VALIDATION)], waited_s=30.4)
    text = stall.describe(now=130.0, log_file="/run/ddpexp.log")
    assert text.startswith("a worker stalled, so the whole run was stopped:\n  rank 1 (pid 1001) "
                           "stalled in data at step 12: no progress for 40 s\n(rank 0 waited 30 s "
                           "for it in validation, longer than trainer.dist_timeout_s; its Python "
                           "stack is in /run/ddpexp.log.")


def test_describe_several_stalled():
    stall = w.Stall(stalled=[beat(1, 1), beat(2, 1)], waiting=[beat(0, 5), beat(3, 5)], waited_s=9)
    text = stall.describe(now=100.0)
    assert text.startswith("2 workers stalled")
    assert "(ranks 0, 3 waited 9 s" in text and "their Python stacks are in the run's log" in text


def test_slots_round_trip(tmp_path, monkeypatch):
    path = w.create_slots(3)
    try:
        assert os.path.getsize(path) == 3 * hb.STRIDE
        assert w.read_beats(path, 3) == []
        beating = hb.Heartbeat(path, local_rank=1, restart=2, rank=5)
        beating.mark(hb.OPTIMIZER, 9)
        (b,) = w.read_beats(path, 3)
        assert (b.rank, b.count, b.step, b.phase, b.pid, b.restart) == (5, 2, 9, hb.OPTIMIZER, os.getpid(), 2)
        beating.close()
        beating.close()  # twice is safe
        assert w.read_beats(path, 3)[0].phase == hb.DONE
    finally:
        os.unlink(path)

