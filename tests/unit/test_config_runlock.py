"""The run-dir lock (config/runlock.py): taken atomically, refused while its holder lives,
taken over with one warning once it is abandoned, refreshed while held, released at the end."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest

from ddpexp.config import cli, runlock
from ddpexp.errors import RunDirBusy

HOST = socket.gethostname()


def write_lock(run_dir: Path, age_s: float = 0.0, **fields) -> Path:
    """A lock as another process would have left it, last refreshed ``age_s`` ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {"host": HOST, "pid": os.getppid(), "start": "2026-12-03T08:00:00+00:00", **fields}
    path = run_dir / runlock.LOCK_FILE
    path.write_text(json.dumps(holder))
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def unused_pid() -> int:
    """A pid that no process of this host has now."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def lock_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "taking over the lock" in r.getMessage()]


def test_acquire_writes_host_pid_start_and_release_removes_it(tmp_path):
    lock = runlock.acquire(tmp_path)
    held = json.loads((tmp_path / ".lock").read_text())
    assert (held["host"], held["pid"]) == (HOST, os.getpid())
    assert held["start"].endswith("+00:00")
    with pytest.raises(FileExistsError):  # created with O_EXCL: nobody else can create it now
        os.open(tmp_path / ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_live_holder_is_refused_by_name(tmp_path):
    path = write_lock(tmp_path)  # the pid of this test's parent process: alive
    before = path.read_text()
    with pytest.raises(RunDirBusy, match=rf"in use by a live run \(pid {os.getppid()} on host "
                                         rf"{HOST}, since 2026-12-03 08:00:00 UTC;"):
        runlock.acquire(tmp_path)
    assert path.read_text() == before


def test_a_gone_pid_is_taken_over_with_one_warning(tmp_path, caplog):
    dead = unused_pid()
    write_lock(tmp_path, pid=dead)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        lock = runlock.acquire(tmp_path)
    (warning,) = lock_warnings(caplog)
    assert f"from pid {dead} on host {HOST}" in warning and "that process is gone" in warning
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert not list(tmp_path.glob(".lock.stale-*"))
    lock.release()


def test_a_reused_pid_is_taken_over(tmp_path, caplog):
    # The pid runs, but it is another process than the one that took the lock.
    write_lock(tmp_path, pid=os.getppid(), pid_start=1)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        runlock.acquire(tmp_path).release()
    assert len(lock_warnings(caplog)) == 1


def test_another_host_is_live_until_its_lock_goes_unrefreshed(tmp_path, caplog):
    write_lock(tmp_path, host="node-elsewhere", pid=1, age_s=runlock.STALE_AFTER_S - 30)
    with pytest.raises(RunDirBusy, match="pid 1 on host node-elsewhere"):
        runlock.acquire(tmp_path)
    write_lock(tmp_path, host="node-elsewhere", pid=1, age_s=runlock.STALE_AFTER_S + 30)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        lock = runlock.acquire(tmp_path)
    (warning,) = lock_warnings(caplog)
    assert "host node-elsewhere" in warning and "not refreshed for" in warning
    lock.release()


def test_a_later_round_of_the_same_slurm_job_takes_over(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(tmp_path, host="node-elsewhere", pid=1, job="SLURM_JOB_ID=77", round=0)
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        runlock.acquire(tmp_path).release()
    assert "round 0 of SLURM_JOB_ID=77" in lock_warnings(caplog)[0]
    write_lock(tmp_path, host="node-elsewhere", pid=1, job="SLURM_JOB_ID=78", round=0)
    with pytest.raises(RunDirBusy):  # another job's
        runlock.acquire(tmp_path)


def test_a_lock_being_written_is_live_for_a_moment(tmp_path):
    path = tmp_path / ".lock"
    path.write_text("")
    with pytest.raises(RunDirBusy, match="a process that is taking it now"):
        runlock.acquire(tmp_path)
    stamp = time.time() - runlock.WRITING_S - 5
    os.utime(path, (stamp, stamp))
    runlock.acquire(tmp_path).release()


def test_the_nodes_of_one_run_share_the_lock(tmp_path):
    path = write_lock(tmp_path, shared_by="rendezvous node0:29400")
    joined = runlock.acquire(tmp_path, shared_by="rendezvous node0:29400")
    assert not joined.owned
    joined.release()
    assert path.exists()  # the owner's, removed by the owner
    with pytest.raises(RunDirBusy):
        runlock.acquire(tmp_path, shared_by="rendezvous node1:29400")


def test_release_leaves_a_lock_that_is_no_longer_its_own(tmp_path):
    lock = runlock.acquire(tmp_path)
    (tmp_path / ".lock").write_text('{"host": "x", "pid": 1, "start": "t"}')
    lock.release()
    assert (tmp_path / ".lock").exists()


def test_a_held_lock_is_refreshed(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "REFRESH_S", 0.05)
    lock = runlock.acquire(tmp_path)
    old = time.time() - 1000
    os.utime(tmp_path / ".lock", (old, old))
    deadline = time.time() + 10
    while (tmp_path / ".lock").stat().st_mtime < old + 500 and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / ".lock").stat().st_mtime > old + 500
    lock.release()


def test_claim_once_per_process_and_the_refusal_is_kept(tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    assert runlock.claim(mine) is runlock.claim(mine)
    write_lock(theirs)
    with pytest.raises(RunDirBusy):
        runlock.claim(theirs)
    (theirs / ".lock").unlink()
    with pytest.raises(RunDirBusy):  # the run already told it is refused stays refused
        runlock.claim(theirs)
    assert runlock.refusal(theirs) is not None
    runlock.release(theirs)
    assert runlock.refusal(theirs) is None
    runlock.release(mine)
    assert not (mine / ".lock").exists()


def test_preflight_refuses_a_live_run_dir_before_hydra(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"x")
    write_lock(run)
    for args in ([f"resume={run}"], [f"resume={run}/checkpoints/last.pt"],
                 [f"hydra.run.dir={run}", "resume=auto"], [f"hydra.run.dir={run}", "overwrite=true"]):
        text = cli.preflight(args)
        assert text is not None and text.startswith(f"run dir {run} is in use by a live run "
                                                    f"(pid {os.getppid()} on host {HOST}"), args
    assert (run / "checkpoints" / "last.pt").exists()  # overwrite=true removed nothing
    (run / ".lock").unlink()
    assert cli.preflight([f"resume={run}"]) is None


def test_preflight_refuses_resuming_a_sweep_with_a_live_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    write_lock(sweep / "1")
    text = cli.preflight(["-m", f"hydra.sweep.dir={sweep}", "resume=auto", "seed=1,2"])
    assert text is not None and text.startswith(f"run dir {sweep / '1'} is in use by a live run")


def test_the_subdir_resolver_locks_first_and_a_busy_dir_gets_no_config(tmp_path):
    from ddpexp.config import rundir

    free, held = tmp_path / "free", tmp_path / "held"
    free.mkdir()
    assert rundir.claimed_subdir(str(free)) == ".hydra"
    assert json.loads((free / ".lock").read_text())["pid"] == os.getpid()
    write_lock(held)
    assert rundir.claimed_subdir(str(held)) is None  # Hydra then saves no config there
    assert sorted(p.name for p in held.iterdir()) == [".lock"]
    assert runlock.refusal(held) is not None


def test_saved_run_dirs_hold_no_lock():
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    assert fixtures.is_dir() and not list(fixtures.rglob(".lock*"))
