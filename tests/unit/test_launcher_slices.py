"""The launcher's slices of the machine: disjoint for jobs that run at once, and a job waits for
its GPUs."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def test_slices_are_disjoint_and_jobs_wait_for_gpus() -> None:
    from ddpexp.sweep.local import Slices

    cores = sorted(os.sched_getaffinity(0))
    slices = Slices(2, ["a", "b", "c"])
    first = slices.take(2)
    assert first is not None and first[1] == ["a", "b"]
    if len(cores) >= 2:
        second = slices.take(1)
        assert second is not None and second[1] == ["c"] and not set(first[0]) & set(second[0])
        assert slices.take(0) is None  # every core slice is in use
        slices.give_back(*second)
    assert slices.take(2) is None  # only "c" is free: a 2-GPU job waits
    assert slices.take(5) is None  # more than the pool: waits for the whole pool...
    slices.give_back(*first)
    whole = slices.take(5)  # ...and then gets it, to fail with the job's own message
    assert whole is not None and whole[1] == ["a", "b", "c"]
