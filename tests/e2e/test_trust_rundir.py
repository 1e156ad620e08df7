"""A run dir named with the quoting Hydra needs (spaces, non-ASCII letters) is the same dir
to the existing-run guard and to ``resume=`` as it is to Hydra: a second run into it is
refused and changes nothing, and ``resume=`` continues it, however the path was quoted."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from helpers import run_cli_here

from ddpexp.config.commands import SWEPT, command_line_override, command_line_values

# A few steps on a tiny synthetic dataset.
TINY = ["data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=32",
        "data.val_samples=16", "data.test_samples=16", "data.batch_size=8", "model=mlp",
        "model.hidden=[8]", "trainer.max_epochs=1", "trainer.progress_bar=false"]
NAME = "outputs/my run é"


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def spellings(key: str, path: str) -> list[str]:
    """The ways a user types ``key=path`` on a shell so that Hydra reads ``path``."""
    forms = [f'{key}="{path}"', f"{key}='{path}'"]
    if path.isascii():  # Hydra's grammar takes bare values of ASCII characters only
        forms += [f"{key}={path}", f"{key}={path.replace(' ', chr(92) + ' ')}"]
    return forms


@pytest.mark.parametrize("name", [NAME, "outputs/my run"], ids=["non-ascii", "ascii"])
def test_a_run_dir_is_guarded_and_resumed_however_it_is_quoted(tmp_path, monkeypatch, capsys, name):
    run_dir = tmp_path / name
    code, text = run_cli_here([*TINY, f'hydra.run.dir="{name}"'], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    before = snapshot(run_dir)
    assert "checkpoints/last.pt" in before

    for arg in spellings("hydra.run.dir", name):
        code, text = run_cli_here([*TINY, arg], tmp_path, monkeypatch, capsys)
        assert code != 0 and "Traceback" not in text, (arg, text)
        assert "already holds a run; a new run there would overwrite its checkpoints" in text, arg
        assert snapshot(run_dir) == before, f"{arg} changed the first run's files"

    # The fix the message names, typed as it is printed, continues the run in its dir.
    hint = re.search(r"Continue it with (.+?), start it over", text).group(1)
    (resume,) = shlex.split(hint)
    assert command_line_values([resume]) == {"resume": name}
    code, text = run_cli_here([*TINY, "trainer.max_epochs=2", resume], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    assert f"resumed from {tmp_path / name}/checkpoints/last.pt at epoch 1" in text
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["epochs"] == 2
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == before[".hydra/config.yaml"]
    assert (run_dir / ".hydra" / "resume-1" / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [Path(name).name]


def test_resume_of_a_quoted_dir_that_exists_is_accepted(tmp_path, monkeypatch, capsys):
    for arg in spellings("resume", NAME):
        code, text = run_cli_here([*TINY, arg], tmp_path, monkeypatch, capsys)
        assert code != 0 and f"resume={NAME} is neither auto, a run dir nor a checkpoint" in text
    code, text = run_cli_here([*TINY, f'hydra.run.dir="{NAME}"'], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    for arg in spellings("resume", NAME):
        code, text = run_cli_here([*TINY, "trainer.max_epochs=2", arg], tmp_path, monkeypatch, capsys)
        assert code == 0, (arg, text)
        assert f"resumed from {tmp_path / NAME}/checkpoints/last.pt" in text


def test_a_quoted_sweep_dir_of_an_earlier_sweep_is_guarded(tmp_path, monkeypatch, capsys):
    job = tmp_path / NAME / "0"
    code, text = run_cli_here([*TINY, f'hydra.run.dir="{NAME}/0"'], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    before = snapshot(job)
    for arg in spellings("hydra.sweep.dir", NAME):
        code, text = run_cli_here(["-m", *TINY, "seed=1,2", arg], tmp_path, monkeypatch, capsys)
        assert code != 0 and "Traceback" not in text, (arg, text)
        assert "already holds 1 run(s) of an earlier sweep" in text and "resume=auto" in text
    assert snapshot(job) == before
    assert sorted(p.name for p in (tmp_path / NAME).iterdir()) == ["0"]


@pytest.mark.parametrize("value", [NAME, "outputs/run", "a\\b", 'say "hi"\\', " lead", "null",
                                   "42", "true", "it's"])
def test_an_override_printed_for_a_user_reads_back_as_its_value(value):
    (word,) = shlex.split(command_line_override("resume", value))
    assert command_line_values([word]) == {"resume": value}


def test_command_line_values_are_what_hydra_reads():
    values = command_line_values(["-m", "--config-dir", "my_conf", "+resume=auto", "seed=1,2",
                                  "~model", "trainer.nodes=2", "overwrite=true", "bad=é"])
    assert values == {"resume": "auto", "seed": SWEPT, "trainer.nodes": 2, "overwrite": True}
    assert command_line_override("resume", "outputs/run") == "resume=outputs/run"


def test_a_relative_resume_is_read_from_where_the_command_ran_even_after_chdir(tmp_path, monkeypatch, capsys):
    """With hydra.job.chdir=true Hydra runs the job inside its run dir; resume=<relative
    path> still means the path as typed, from where the command was started."""
    code, text = run_cli_here([*TINY, "hydra.run.dir=outputs/first"], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    code, text = run_cli_here([*TINY, "trainer.max_epochs=2", "hydra.job.chdir=true",
                               "resume=outputs/first"], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    assert "resumed from" in text and json.loads((tmp_path / "outputs/first/metrics.json").read_text())["epochs"] == 2
