"""The parts of provenance, diff and rerun that need no run: a repo's state read from git,
patches cut by file, the recorded command rebuilt (paths moved into a worktree), data
fingerprints."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ddpexp import provenance
from ddpexp.diff import changes, split_patch
from ddpexp.provenance import data, git
from ddpexp.rerun import command_args


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True, timeout=30).stdout


def test_repo_state_names_changed_and_untracked_files(tmp_path: Path):
    _git(tmp_path, "init", "-q", "-b", "dev")
    (tmp_path / "my model.py").write_text("a = 1\n")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "config.yaml").write_text("x: 1\n")  # a run's output, not source
    _git(tmp_path, "add", "my model.py")
    _git(tmp_path, "commit", "-qm", "one")
    (tmp_path / "my model.py").write_text("a = 2\n")
    (tmp_path / "new.py").write_text("b = 1\n")
    (tmp_path / "data.bin").write_bytes(b"\0" * 10)
    record, patch = git.repo_state(tmp_path)
    assert record["commit"] == _git(tmp_path, "rev-parse", "HEAD").strip()
    assert record["branch"] == "dev" and record["dirty"] and record["changed"] == ["my model.py"]
    assert [u["path"] for u in record["untracked"]] == ["new.py"]
    assert record["untracked"][0]["sha256"] == git.file_sha256(tmp_path / "new.py")
    assert "-a = 1\n+a = 2" in patch and list(split_patch(patch)) == ["my model.py"]
    assert git.repo_root(tmp_path / "new.py") == tmp_path.resolve()


def test_a_repo_without_a_commit_or_git(tmp_path: Path):
    _git(tmp_path, "init", "-q")
    record, patch = git.repo_state(tmp_path)
    assert record["commit"] is None and not record["dirty"] and patch == ""
    record, _ = git.repo_state(tmp_path / "missing")
    assert "error" in record


def test_command_args_repeat_flags_and_the_jobs_overrides(tmp_path: Path):
    record = {"command": {"argv": ["-m", "--config-dir", "conf", "-cn", "config", "lr=1,2"],
                          "cwd": str(tmp_path / "proj"),
                          "job_overrides": ["lr=1", "hydra.run.dir=x", "resume=auto"]}}
    assert command_args(record, ["seed=3"]) == ["--config-dir", "conf", "-cn", "config", "lr=1",
                                                 "seed=3"]
    (tmp_path / "proj" / "conf").mkdir(parents=True)
    moved = command_args(record, [], (tmp_path / "proj", tmp_path / "wt"))
    assert moved[:4] == ["--config-dir", str(tmp_path / "wt" / "conf"), "-cn", "config"]


def test_fingerprints_hash_small_files_whole_and_sample_large_ones(tmp_path: Path, monkeypatch):
    small, large = tmp_path / "small.txt", tmp_path / "large.bin"
    small.write_text("abc")
    large.write_bytes(bytes(range(256)) * 4096)
    monkeypatch.setattr(data, "FULL_HASH_BYTES", 1024)
    monkeypatch.setattr(data, "SAMPLE_BYTES", 64)
    assert data.fingerprint(small)["sha256"] == git.file_sha256(small)
    entry = data.fingerprint(large)
    assert "sha256" not in entry and entry["sampled_sha256"] and entry["size"] == 1 << 20
    assert data.fingerprint(tmp_path / "gone")["error"]


def test_changes_and_config_hash():
    assert changes({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == [
        {"key": "b", "a": 2, "b": 3}, {"key": "c", "a": "(absent)", "b": 4}]
    assert provenance.config_hash({"x": 1, "y": [1]}) == provenance.config_hash({"y": [1], "x": 1})
    assert provenance.config_hash({"x": 1}) != provenance.config_hash({"x": 2})


def test_rerun_checks_packages_data_and_who_started_the_ranks(tmp_path: Path):
    import platform

    from ddpexp.rerun import check

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abc")
    record = {"packages": {**provenance.installed_packages(), "torch": "0.1"},
              "versions": {"python": platform.python_version()},
              "data": {"files": [data.fingerprint(corpus)]},
              "machine": {"world": {"launcher": "torchrun", "ranks": 2}},
              "command": {"line": "python -m ddpexp model=mlp"}}
    corpus.write_text("abcd")
    problems = check(record, tmp_path)
    assert problems[0].startswith("package torch: recorded 0.1, installed ")
    assert problems[1] == f"data: {corpus} changed since the run (size differs)"
    assert problems[2].startswith("world: 2 rank(s) that torchrun started;")
    assert len(problems) == 3


def test_rerun_checks_the_untracked_files_and_the_commit(tmp_path: Path):
    from ddpexp.rerun import _code_problems

    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("a = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "one")
    (tmp_path / "new.py").write_text("b = 1\n")
    record, _ = git.repo_state(tmp_path)
    assert _code_problems(record, tmp_path) == []
    (tmp_path / "new.py").write_text("b = 2\n")
    assert _code_problems(record, tmp_path) == [
        f"code: untracked {tmp_path.resolve() / 'new.py'} changed since the run"]
    (tmp_path / "new.py").unlink()
    _git(tmp_path, "commit", "-qm", "two", "--allow-empty")
    problems = _code_problems(record, tmp_path)
    assert problems[0].startswith(f"code: {tmp_path.resolve()} is at commit ")
    assert problems[1] == f"code: untracked {tmp_path.resolve() / 'new.py'} is gone"
