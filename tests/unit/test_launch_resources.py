"""What the machine can give a run (launch/resources.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ddpexp.errors import ConfigError
from ddpexp.launch import resources

GiB = 2**30


def plan(procs, gpus=0):
    return SimpleNamespace(procs=procs, gpus=gpus)


def test_one_worker_is_never_refused():
    resources.check_resources(plan(1), available=1, cores=1)


def test_too_many_workers_for_memory():
    with pytest.raises(ConfigError, match=r"trainer.procs=8 starts 8 worker processes, at least "
                                          r"2.3 GiB of memory at ~300 MiB each, but 1.0 GiB is "
                                          r"available; use trainer.procs=3 or fewer"):
        resources.check_resources(plan(8), available=GiB, cores=16)


def test_fit_is_at_least_one():
    with pytest.raises(ConfigError, match="use trainer.procs=1 or fewer"):
        resources.check_resources(plan(2), available=10, cores=16)


def test_more_cpu_workers_than_cores_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        resources.check_resources(plan(4), available=64 * GiB, cores=2)
    assert "trainer.procs=4 CPU workers on 2 core(s): they will take turns" in caplog.text


def test_gpu_workers_do_not_count_cores(caplog):
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        resources.check_resources(plan(4, gpus=4), available=64 * GiB, cores=2)
    assert caplog.text == ""


def test_memory_available_reads_proc():
    found = resources.memory_available()
    assert found is None or found > 0


def test_oom_kills_is_count_or_unknown():
    kills = resources.oom_kills()
    assert kills is None or kills >= 0


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of two cores or more")
def test_a_rank_bound_to_one_core_counts_its_launchers_cores():
    """As mpirun binds each rank to a core of its own: the rank's mask is one core, its
    parent's (this test process, the launcher here) all of them."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from ddpexp.launch.resources import node_cores; "
            "print(node_cores(), node_cores(launched_elsewhere=True))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["1", str(len(os.sched_getaffinity(0)))]
