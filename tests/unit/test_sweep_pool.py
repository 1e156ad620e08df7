"""The machine cut into slices for a sweep's parallel jobs (the local backend's Slices and
Packing, sweep/local.py)."""

from __future__ import annotations

import logging

import pytest

from ddpexp.sweep import local


@pytest.fixture
def cores(monkeypatch):
    def have(n):
        monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: set(range(n)))
    return have


def test_cores_split_evenly(cores):
    cores(7)
    s = local.Slices(3, [])
    assert s.free_cores == [[0, 1, 2], [3, 4], [5, 6]] and s.split


def test_one_job_gets_everything(cores):
    cores(4)
    s = local.Slices(1, ["0", "1"])
    assert not s.split
    assert s.take(2) == ([0, 1, 2, 3], ["0", "1"])
    assert s.take(0) is None


def test_more_parallel_than_cores_warns(cores, caplog):
    cores(2)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        s = local.Slices(5, [])
    assert s.free_cores == [[0], [1]]
    assert "max_parallel=5 but this process may use 2 cores: running 2 jobs at once" in caplog.text


def test_gpus_taken_and_given_back_in_order(cores):
    cores(4)
    s = local.Slices(2, ["0", "1", "2"])
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
    s = local.Slices(2, ["0", "1"])
    first = s.take(1)
    assert s.take(5) is None  # waits for the whole pool
    s.give_back(*first)
    assert s.take(5) == ([0, 1], ["0", "1"])


def test_add_gpus(cores):
    cores(2)
    s = local.Slices(2, [])
    s.add_gpus(["3", "5"])
    assert s.take(1) == ([0], ["3"])


def test_packing_gives_each_job_a_core_per_worker_and_never_more_than_there_are(cores):
    cores(4)
    s = local.Packing([])
    two = s.take(0, workers=2)
    one = s.take(0, workers=1)
    assert two == ([0, 1], []) and one == ([2], [])
    assert s.take(0, workers=2) is None  # one core left: a 2-worker job waits
    assert s.take(0, workers=1) == ([3], [])
    assert s.free == 0 and s.take(0) is None
    s.give_back(*two)
    assert s.free_cores == [0, 1] and s.take(0, workers=2) == ([0, 1], [])


def test_packing_gives_a_job_larger_than_the_machine_all_of_it_once_idle(cores):
    cores(2)
    s = local.Packing([])
    first = s.take(0, workers=1)
    assert s.take(0, workers=4) is None
    s.give_back(*first)
    assert s.take(0, workers=4) == ([0, 1], [])


def test_packing_on_a_gpu_box_takes_free_gpus_and_their_share_of_the_cores(cores):
    cores(8)
    s = local.Packing(["0", "1", "2", "3"])
    a = s.take(1, workers=1)
    b = s.take(2, workers=2)
    assert a == ([0, 1], ["0"]) and b == ([2, 3, 4, 5], ["1", "2"])
    assert s.take(2, workers=2) is None  # one GPU left
    cpu = s.take(0, workers=1)  # a CPU job of the sweep still fits beside them
    assert cpu == ([6], [])
    s.give_back(*b)
    assert s.take(2, workers=2) == ([2, 3, 4, 5], ["1", "2"])


def test_packing_starts_no_job_below_the_memory_a_finished_job_peaked_at(cores, monkeypatch):
    cores(4)
    free = {"bytes": 8 << 30}
    monkeypatch.setattr(local, "available_memory", lambda: free["bytes"])
    s = local.Packing([])
    first = s.take(0)
    s.saw_peak(6 << 30)
    assert s.take(0) == ([1], [])  # 8 GiB available, a job peaked at 6
    free["bytes"] = 5 << 30
    assert s.take(0) is None
    s.give_back(*first)
    s.give_back([1], [])
    assert s.take(0) == ([0], [])  # an idle machine always starts the next job


def test_packing_counts_the_cores_where_there_is_no_affinity_mask(monkeypatch):
    """Without sched_getaffinity (macOS) packing still starts a job a core, not all at once."""
    monkeypatch.delattr(local.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(local.os, "cpu_count", lambda: 2)
    s = local.Packing([])
    assert s.take(0) == ([0], []) and s.take(0) == ([1], []) and s.take(0) is None


def test_max_parallel_chooses_equal_slices_and_null_packs(cores):
    from ddpexp.sweep.settings import LocalSettings

    cores(4)
    assert isinstance(local.make_slices(LocalSettings(max_parallel=None)), local.Packing)
    slices = local.make_slices(LocalSettings(max_parallel=2))
    assert isinstance(slices, local.Slices) and slices.free_cores == [[0, 1], [2, 3]]


@pytest.mark.parametrize("trainer,workers", [
    ({}, 1), ({"procs": 2}, 2), ({"procs": None, "gpus": 3}, 3), ({"procs": 1, "gpus": 0}, 1),
    ({"strategy": "dp", "gpus": 4}, 1),
])
def test_a_jobs_workers_come_from_its_trainer(trainer, workers):
    from omegaconf import OmegaConf

    from ddpexp.sweep.job import job_workers

    assert job_workers(OmegaConf.create({"trainer": trainer})) == workers


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
