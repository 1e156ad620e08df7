"""The machine cut into slices for a sweep's parallel jobs (sweep/pool.py's Slices)."""

from __future__ import annotations

import logging

import pytest

from ddpexp.sweep import pool


@pytest.fixture
def cores(monkeypatch):
    def have(n):
        monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: set(range(n)))
    return have


def test_cores_split_evenly(cores):
    cores(7)
    s = pool.Slices(3, [])
    assert s.free_cores == [[0, 1, 2], [3, 4], [5, 6]] and s.split


def test_one_job_gets_everything(cores):
    cores(4)
    s = pool.Slices(1, ["0", "1"])
    assert not s.split
    assert s.take(2) == ([0, 1, 2, 3], ["0", "1"])
    assert s.take(0) is None


def test_more_parallel_than_cores_warns(cores, caplog):
    cores(2)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        s = pool.Slices(5, [])
    assert s.free_cores == [[0], [1]]
    assert "max_parallel=5 but this process may use 2 cores: running 2 jobs at once" in caplog.text


def test_gpus_taken_and_given_back_in_order(cores):
    cores(4)
    s = pool.Slices(2, ["0", "1", "2"])
    a = s.take(2)
    assert a == ([0, 1], ["0", "1"])
    assert s.take(2) is None  # one GPU left
    b = s.take(1)
    assert b == ([2, 3], ["2"])
    s.give_back(*a)
    assert s.free_cores == [[0, 1]] and s.free_gpus == ["0", "1"]
    s.give_back(*b)
    assert s.free_cores == [[0, 1], [2, 3]] and s.free_gpus == ["0", "1", "2"]


def test_job_wanting_more_gpus_than_pool_gets_idle_pool(cores):
    cores(4)
    s = pool.Slices(2, ["0", "1"])
    first = s.take(1)
    assert s.take(5) is None  # waits for the whole pool
    s.give_back(*first)
    assert s.take(5) == ([0, 1], ["0", "1"])


def test_add_gpus(cores):
    cores(2)
    s = pool.Slices(2, [])
    s.add_gpus(["3", "5"])
    assert s.take(1) == ([0], ["3"])


def test_fork_server_refuses_to_fork_with_a_thread_running():
    """The server forks only while it has no Python thread besides its main one and no
    native thread more than after its imports."""
    import threading

    from ddpexp.sweep import forkserver

    baseline = forkserver.native_threads()
    assert forkserver._unsafe(baseline) is None
    assert "threads, 1 more" in forkserver._unsafe(baseline - 1)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    try:
        assert "(left-running)" in forkserver._unsafe(forkserver.native_threads())
    finally:
        stop.set()
        thread.join()
