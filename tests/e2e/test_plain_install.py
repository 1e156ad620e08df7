"""The package installed the plain way (not editable) into another directory runs: the
config ships inside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import only_run_dir, read_metrics, run_cli


@pytest.mark.slow
@pytest.mark.host
def test_plain_install_into_another_directory(tmp_path):
    """The config ships inside the package: a non-editable install elsewhere still runs."""
    repo = Path(__file__).parents[2]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(repo)], check=True, timeout=300, cwd=tmp_path)
    assert (target / "ddpexp" / "conf" / "config.yaml").is_file()
    env = {"PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import ddpexp; print(ddpexp.__file__)"],
                           env={**os.environ, **env}, capture_output=True, text=True, cwd=tmp_path)
    assert where.stdout.startswith(str(target))
    run_cli(["model=mlp", "trainer.max_steps=3"], tmp_path, env=env)
    assert read_metrics(only_run_dir(tmp_path))["steps"] == 3
