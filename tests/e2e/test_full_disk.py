"""A disk that fills up during a run (a small tmpfs): one message that names the file and
what to free, a ``failed`` record in metrics.json, the last checkpoint intact, and no
"--- Logging error ---" traceback on the terminal, with one worker (in this process) as with
two, and under fsdp, whose ranks each write shards."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest
from helpers import read_metrics, run_cli, run_cli_in_process

# A checkpoint of some 300 kB (the weights and SGD's momentum) against a few kB of logs.
ARGS = ["data=synthetic", "data.shape=[64]", "data.num_classes=3", "data.num_samples=64",
        "data.val_samples=16", "data.test_samples=16", "data.batch_size=16", "model=mlp",
        "model.hidden=[512]", "optimizer.momentum=0.9", "trainer.progress_bar=false",
        "trainer.test=false"]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs at ``tmp_path/disk`` and a function that shrinks it to what it holds plus
    ``free`` bytes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"mounting a tmpfs is not allowed here: {mounted.stderr.strip()}")

    def shrink(free: int) -> None:
        size = (shutil.disk_usage(disk).used + free) // 1024 + 4
        subprocess.run(["mount", "-o", f"remount,size={size}k", str(disk)], check=True)

    try:
        yield disk, shrink
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _snapshot(last):
    """Every byte of a checkpoint: a file, or a sharded checkpoint's directory of shards."""
    files = sorted(p for p in last.rglob("*") if p.is_file()) if last.is_dir() else [last]
    return {p: p.read_bytes() for p in files}


def _a_run_then_a_full_disk(tmp_path, small_disk, args=ARGS, in_process=True):
    """A run of one epoch on the small disk, which then keeps room for half a checkpoint
    only: the resumed run's first save cannot fit."""
    disk, shrink = small_disk
    run = disk / "run"
    first = [*args, "trainer.max_epochs=1", f"hydra.run.dir={run}"]
    if in_process:
        run_cli_in_process(first, tmp_path)
    else:
        run_cli(first, tmp_path, timeout=180)
    last = run / "checkpoints" / "last.pt"
    before = _snapshot(last)
    shrink(sum(map(len, before.values())) // 2)
    return run, last, before


def _check(res, run, last, before) -> None:
    assert res.returncode != 0
    message = f"no space left on the device that holds {last}. Free some space there"
    assert res.output.count(message) == 1, res.output
    assert "Logging error" not in res.output and "Traceback" not in res.output, res.output
    metrics = read_metrics(run)
    assert metrics["status"] == "failed" and message in metrics["error"]
    assert _snapshot(last) == before  # the last checkpoint, whole
    assert not [p for p in last.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_full_disk_under_one_worker(tmp_path, small_disk, async_save):
    """Written in the background (``trainer.async_save=true``) the failed save is reported
    as in the loop: once, as the run's failure."""
    run, last, before = _a_run_then_a_full_disk(tmp_path, small_disk)
    res = run_cli_in_process([*ARGS, "trainer.max_epochs=3", f"trainer.async_save={async_save}",
                              f"resume={run}"], tmp_path, expect_ok=False)
    _check(res, run, last, before)


@pytest.mark.slow
def test_a_full_disk_under_two_workers(tmp_path, small_disk):
    run, last, before = _a_run_then_a_full_disk(tmp_path, small_disk)
    res = run_cli([*ARGS, "trainer.max_epochs=3", "trainer.procs=2", f"resume={run}"], tmp_path,
                  expect_ok=False, timeout=180)
    _check(res, run, last, before)


@pytest.mark.slow
def test_a_full_disk_under_fsdp(tmp_path, small_disk):
    """Sharded checkpoints: every rank writes shards of its own and meets the full disk;
    the run still ends with the one message, and every shard of the last checkpoint (a
    directory) is as it was."""
    fsdp = [*ARGS, "trainer.procs=2", "trainer.strategy=fsdp"]
    run, last, before = _a_run_then_a_full_disk(tmp_path, small_disk, fsdp, in_process=False)
    assert last.is_dir() and len(before) > 2
    res = run_cli([*fsdp, "trainer.max_epochs=3", f"resume={run}"], tmp_path, expect_ok=False,
                  timeout=180)
    _check(res, run, last, before)


def test_a_tiny_disk_names_the_file_and_no_thread_traceback(tmp_path, small_disk):
    """A disk with room for the config and the log only: TensorBoard's event file and then
    the first checkpoint meet it full. The event file costs one warning naming ``tb/`` (not
    a traceback of TensorBoard's writer thread), and the run ends with one message naming the
    checkpoint, which the archive writer only met as its file was closed."""
    disk, shrink = small_disk
    shrink(16 * 1024)
    run = disk / "run"
    res = run_cli_in_process([*ARGS, "trainer.max_epochs=1", f"hydra.run.dir={run}"], tmp_path,
                             expect_ok=False)
    assert res.returncode != 0
    last = run / "checkpoints" / "last.pt"
    assert res.output.count(f"no space left on the device that holds {last}.") == 1, res.output
    assert "Traceback" not in res.output and "Exception in thread" not in res.output, res.output
    assert f"logger.tensorboard could not open (OSError: [Errno 28] No space left on device: " \
           f"'{run / 'tb'}')" in res.output
    assert "a file" not in res.output


def test_a_full_sweep_dir_keeps_the_jobs_and_names_the_table(tmp_path, small_disk):
    """The sweep's table cannot be written once the disk is full: the sweep ends with one
    message naming ``summary.csv`` (a ddpexp error, not the writer's raw OSError), and what
    the jobs and the earlier table wrote is kept, with no partial file beside it."""
    from hydra.core.utils import JobReturn, JobStatus

    from ddpexp.errors import DdpexpError
    from ddpexp.record import write_metrics
    from ddpexp.sweep.backend import Job
    from ddpexp.sweep.summary import summarize

    disk, shrink = small_disk
    sweep = disk / "sweep"
    outcomes: dict = {}
    jobs = []
    for idx in range(2):
        (sweep / str(idx)).mkdir(parents=True)
        write_metrics(sweep / str(idx), {"status": "completed", "monitor": "val/acc",
                                         "best": {"val/acc": 0.5 + idx / 10}, "wall_time_s": 1})
        jobs.append(Job(idx=idx, overrides=[f"seed={idx}"], dir=sweep / str(idx), started=1,
                        ended=2, ret=JobReturn(overrides=[f"seed={idx}"],
                                               status=JobStatus.COMPLETED, _return_value=0.5)))
    summarize(outcomes, jobs[:1], sweep, final=False)  # the first job's row, while there was room
    table = (sweep / "summary.csv").read_bytes()
    kept = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    shrink(0)
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
        while True:  # every byte the tmpfs has left
            filler.write(b"x" * 1024)
            filler.flush()
    with pytest.raises(DdpexpError) as raised:
        summarize(outcomes, jobs, sweep)
    message = str(raised.value)
    assert message.startswith("the sweep's table could not be written: no space left on the "
                              f"device that holds {sweep / 'summary.csv'}. Free some space there, "
                              "or point hydra.sweep.dir at another disk"), message
    assert f"python -m ddpexp.report {sweep} shows the table" in message
    assert (sweep / "summary.csv").read_bytes() == table
    assert {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()} == kept
