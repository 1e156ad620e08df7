"""Mistakes whose check needs a process of its own: the traceback that HYDRA_FULL_ERROR=1
asks for (Hydra re-raises it, so only a process's exit shows it), and file systems that are
full or read-only (mounted for the test)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli, run_cli_here

from ddpexp.config.rundir import writable_dir_problem


def test_full_error_shows_the_traceback(workdir):
    res = run_cli(["trainer.precision=8"], workdir, expect_ok=False, env={"HYDRA_FULL_ERROR": "1"})
    assert res.returncode != 0 and "Traceback" in res.stderr


def _mount_tmpfs(path: Path, options: str) -> bool:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def full_disk(tmp_path):
    """A file system with room for a run's config and log but not its checkpoint (a small
    tmpfs; mounting one needs root)."""
    path = tmp_path / "small"
    path.mkdir()
    if os.geteuid() != 0 or not _mount_tmpfs(path, "size=160k"):
        pytest.skip("no small file system can be mounted here")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)  # lazily: a log may still be open


def test_a_full_disk_is_one_message(full_disk, tmp_path, monkeypatch, capsys):
    run_dir = full_disk / "run"
    code, text = run_cli_here([f"hydra.run.dir={run_dir}", "trainer.max_epochs=1"], tmp_path,
                              monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text and "unexpected pos" not in text
    assert f"no space left on the device that holds {run_dir}/checkpoints/last.pt" in text
    assert "point hydra.run.dir at another disk" in text
    assert not list((run_dir / "checkpoints").glob("*.pt*"))  # no partial checkpoint
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "no space left" in metrics["error"]


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory nobody may write to: a read-only mount for root (whom permissions do not
    stop), a mode-555 dir for anyone else."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if not _mount_tmpfs(path, "ro,size=64k"):
        pytest.skip("root, and no read-only mount possible here")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)  # lazily: a log may still be open


def test_an_unwritable_output_dir_is_one_message(readonly_dir, tmp_path, monkeypatch, capsys):
    assert "cannot create the run dir" in writable_dir_problem(readonly_dir / "run")
    code, text = run_cli_here([f"hydra.run.dir={readonly_dir}/run"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text
    assert f"cannot create the run dir {readonly_dir}/run" in text and "hydra.run.dir" in text
    # The default ./outputs in a directory that cannot be written.
    code, text = run_cli_here([], readonly_dir, monkeypatch, capsys)
    assert code != 0 and "cannot create the run dir outputs" in text and "Traceback" not in text
