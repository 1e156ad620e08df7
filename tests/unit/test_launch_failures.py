"""How an operating-system error is told to the user (launch/failures.py)."""

from __future__ import annotations

import errno

import pytest

from ddpexp.errors import ConfigError
from ddpexp.launch import failures


@pytest.mark.parametrize("code, message", [
    (errno.ENOSPC, (r"no space left on the device that holds /data/x. Free some space there, or "
                    r"point data.root at another disk \(nothing already saved was replaced")),
    (errno.EDQUOT, r"disk quota exceeded writing /data/x. Free some space, or point data.root"),
    (errno.EACCES, r"permission denied: /data/x. Give this user access to it, or point data.root"),
    (errno.EPERM, r"permission denied: /data/x"),
    (errno.EROFS, r"/data/x is on a read-only file system; point data.root at a writable place"),
])
def test_explain_os_error(code, message):
    exc = failures.explain_os_error(OSError(code, "strerror", "/data/x"), data_root="/data")
    assert isinstance(exc, ConfigError)
    with pytest.raises(ConfigError, match=message):
        raise exc


def test_key_for_run_dir_and_unknown():
    exc = failures.explain_os_error(OSError(errno.EIO, "I/O error", "/runs/a/last.pt"),
                                    data_root="/data", run_dir="/runs/a")
    assert str(exc) == "I/O error: /runs/a/last.pt (check hydra.run.dir)"
    exc = failures.explain_os_error(OSError(errno.EIO, "I/O error", "/elsewhere/x"))
    assert str(exc) == "I/O error: /elsewhere/x (check data.root or hydra.run.dir)"
    exc = failures.explain_os_error(OSError(errno.ENOSPC, "full", "/sweeps/s/summary.csv"),
                                    sweep_dir="/sweeps/s")
    assert "holds /sweeps/s/summary.csv. Free some space there, or point hydra.sweep.dir" in str(exc)


def test_an_error_that_names_no_file_names_the_run_dir():
    """A write that met the full disk only as its file was closed names no file: the message
    places it in the run dir, where the run writes."""
    exc = failures.explain_os_error(OSError(errno.ENOSPC, "full"), run_dir="/runs/a")
    assert str(exc).startswith("no space left on the device that holds a file in /runs/a. "
                               "Free some space there, or point hydra.run.dir at another disk")
    assert "a file in the run dir" in str(failures.explain_os_error(OSError(errno.EIO, "bad")))


def test_naming_gives_an_error_its_file():
    from ddpexp.errors import naming

    named = naming(OSError(errno.ENOSPC, "No space left on device"), "/runs/a/last.pt")
    assert (named.errno, named.filename) == (errno.ENOSPC, "/runs/a/last.pt")
    assert str(named) == "[Errno 28] No space left on device: '/runs/a/last.pt'"
    own = FileNotFoundError(errno.ENOENT, "gone", "/data/x")
    assert naming(own, "/elsewhere") is own


def test_newest_config_dir(tmp_path):
    assert failures._newest_config_dir(tmp_path) == tmp_path / ".hydra"
    for name in ("resume-1", "resume-10", "resume-2", "resume-x"):
        (tmp_path / ".hydra" / name).mkdir(parents=True)
    assert failures._newest_config_dir(tmp_path) == tmp_path / ".hydra" / "resume-10"


def _hydra(mode="RUN"):
    from types import SimpleNamespace

    from hydra.types import RunMode

    return SimpleNamespace(mode=RunMode[mode], job=SimpleNamespace(name="ddpexp"))


def _before_the_first_step(run):
    """What a run that failed before its first step leaves: its config, its log and the
    failure's record."""
    (run / ".hydra").mkdir(parents=True)
    (run / "ddpexp.log").write_text("x")
    (run / "metrics.json").write_text('{"status": "failed", "error": "task.metrics: ..."}')
    return run


def test_tidy_removes_a_run_that_failed_before_its_first_step(tmp_path):
    run = _before_the_first_step(tmp_path / "run")
    failures._tidy(run, run / ".hydra", run / "checkpoints" / "last.pt", None, _hydra())
    assert not run.exists()
    # A sweep job's dir stays, its error in its record.
    job = _before_the_first_step(tmp_path / "job")
    failures._tidy(job, job / ".hydra", job / "checkpoints" / "last.pt", None, _hydra("MULTIRUN"))
    assert (job / "metrics.json").exists()


def test_tidy_removes_a_run_that_failed_before_its_first_step_with_its_lock(tmp_path):
    run = _before_the_first_step(tmp_path / "run")
    (run / ".lock").write_text("{}")  # the run's own, released once it is reported
    failures._tidy(run, run / ".hydra", run / "checkpoints" / "last.pt", None, _hydra())
    assert not run.exists()


@pytest.mark.parametrize("work", ["metrics.json", "tb", "notes.log", "mine.txt"])
def test_tidy_keeps_a_dir_with_work_or_files_of_others(tmp_path, work):
    run = _before_the_first_step(tmp_path / "run")
    if work == "metrics.json":  # the trainer's record counts steps
        (run / work).write_text('{"status": "failed", "steps": 3}')
    elif work == "tb":
        (run / work).mkdir()
    else:
        (run / work).write_text("mine")
    failures._tidy(run, run / ".hydra", run / "checkpoints" / "last.pt", None, _hydra())
    assert (run / "metrics.json").exists() and (run / work).exists()


def test_tidy_removes_unused_resume_config(tmp_path):
    run = tmp_path / "run"
    resume = run / ".hydra" / "resume-1"
    resume.mkdir(parents=True)
    (run / "checkpoints").mkdir()
    last = run / "checkpoints" / "last.pt"
    last.write_bytes(b"x")
    stamp = failures._stamp(last)
    failures._tidy(run, resume, last, stamp, _hydra())
    assert not resume.exists() and last.exists()


def test_select_unresolvable_is_none():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"data": {"root": "${oc.env:DDPEXP_SURELY_UNSET_VAR}"}})
    assert failures._select(cfg, "data.root") is None
    assert failures._select(OmegaConf.create({"data": {"root": "/x"}}), "data.root") == "/x"
