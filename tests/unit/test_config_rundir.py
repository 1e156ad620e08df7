"""Run dirs claimed, found for resume=, and where Hydra saves a job's config
(config/rundir.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpexp.config import rundir
from ddpexp.errors import ConfigError


def test_unique_dir_claims_fresh_names(tmp_path):
    base = tmp_path / "outputs" / "12-00-00"
    assert rundir.unique_dir(str(base)) == str(base)
    assert base.is_dir()
    rundir._CLAIMED.clear()  # another process in the same second
    assert rundir.unique_dir(str(base)) == str(base) + "-1"
    rundir._CLAIMED.clear()
    assert rundir.unique_dir(str(base)) == str(base) + "-2"


def test_unique_dir_same_answer_in_one_process(tmp_path):
    base = str(tmp_path / "d")
    first = rundir.unique_dir(base)
    assert rundir.unique_dir(base) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert rundir.claimed_dirs() == {first}


def test_unique_dir_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    rundir.unique_dir("run")
    monkeypatch.chdir(tmp_path / "b")
    rundir.unique_dir("run")
    assert (tmp_path / "a" / "run").is_dir() and (tmp_path / "b" / "run").is_dir()


def test_unique_dir_unwritable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"cannot create the run dir .*file/run: .* Run from a "
                                          r"directory you can write to, or point hydra.run.dir"):
        rundir.unique_dir(str(blocker / "run"))


def test_writable_dir_problem(tmp_path):
    assert rundir.writable_dir_problem(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert rundir.writable_dir_problem(blocker / "run") == (
        f"cannot create the run dir {blocker / 'run'}: {blocker} is not a directory")


def test_resume_dir(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "last.pt"
    ckpt.write_bytes(b"x")
    fresh = str(tmp_path / "fresh")
    assert rundir.resume_dir(str(run), fresh) == str(run)
    assert rundir.resume_dir(str(ckpt), fresh) == str(run)
    assert not (tmp_path / "fresh").exists()  # not claimed when not the answer
    assert rundir.resume_dir("auto", fresh) == fresh and (tmp_path / "fresh").is_dir()


def test_resume_dir_other_file_is_fresh(tmp_path):
    other = tmp_path / "weights.pt"
    other.write_bytes(b"x")
    assert rundir.resume_dir(str(other), str(tmp_path / "f")) == str(tmp_path / "f")
    assert rundir.resume_dir(None, str(tmp_path / "f")) == str(tmp_path / "f")


def test_hydra_subdir(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert rundir.hydra_subdir(str(tmp_path)) == ".hydra"
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("a: 1")
    assert rundir.hydra_subdir(str(tmp_path)) == ".hydra/resume-1"
    (tmp_path / ".hydra" / "resume-1").mkdir()
    assert rundir.hydra_subdir(str(tmp_path)) == ".hydra/resume-2"


def test_hydra_subdir_later_slurm_task(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert rundir.hydra_subdir(str(tmp_path)) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert rundir.hydra_subdir(str(tmp_path)) == ".hydra"
    monkeypatch.setenv("SLURM_PROCID", "zero")
    assert rundir.hydra_subdir(str(tmp_path)) == ".hydra"


def test_holds_run(tmp_path):
    assert not rundir.holds_run(tmp_path)
    (tmp_path / "metrics.json").write_text("{}")
    assert rundir.holds_run(tmp_path)


def test_unused_claims_are_dropped_with_the_parents_they_leave_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stray = Path(rundir.unique_dir("outputs/2026-01-01/10-00-00"))
    used = Path(rundir.unique_dir("outputs/debug/2026-01-01/10-00-00"))
    kept = Path(rundir.unique_dir("outputs/2026-01-01/10-00-01"))
    (kept / "notes.txt").write_text("a run's")
    rundir.drop_unused_claims(used)
    assert not stray.exists() and used.is_dir() and (kept / "notes.txt").exists()
    assert (tmp_path / "outputs").is_dir()


def test_a_run_interrupted_before_training_may_be_started_again_in_its_dir(tmp_path):
    (tmp_path / "metrics.json").write_text('{"status": "interrupted", "wall_time_s": 2.0}')
    assert rundir.interrupted_before_training(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert rundir.interrupted_before_training(tmp_path)  # an empty checkpoints/ holds nothing
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    assert rundir.has_checkpoint(tmp_path) and not rundir.interrupted_before_training(tmp_path)
    (tmp_path / "checkpoints" / "last.pt").unlink()
    (tmp_path / "metrics.json").write_text('{"status": "interrupted", "steps": 3}')
    assert not rundir.interrupted_before_training(tmp_path)
    (tmp_path / "metrics.json").write_text('{"status": "failed"}')
    assert not rundir.interrupted_before_training(tmp_path)
