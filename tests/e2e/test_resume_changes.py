"""A resume that changes a key: applied from the resumed step and listed in the log and in
``metrics.json`` (optimizer values, limits), or refused naming the key and both values
before anything is written (the model). Whole CLI runs of one worker, in this process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, read_scalars, run_cli_here

# 4 steps an epoch; the lr logged every step.
TINY = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=32",
    "data.val_samples=16", "data.batch_size=8", "model=mlp", "model.hidden=[8]",
    "trainer.log_every_n_steps=1", "callbacks.lr_monitor.every_n_steps=1", "trainer.test=false",
]


def _first_run(workdir: Path, monkeypatch, capsys, *extra: str) -> Path:
    run_dir = workdir / "outputs" / "run"
    code, text = run_cli_here([*TINY, *extra, "trainer.max_epochs=1", f"hydra.run.dir={run_dir}"],
                              workdir, monkeypatch, capsys)
    assert code == 0, text
    return run_dir


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_a_changed_lr_is_applied_logged_and_recorded(workdir, monkeypatch, capsys):
    run_dir = _first_run(workdir, monkeypatch, capsys)
    code, text = run_cli_here([*TINY, "trainer.max_epochs=2", "optimizer.lr=0.5",
                               f"resume={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    log = (run_dir / "ddpexp.log").read_text()
    assert log.count("resume: optimizer.lr 0.05 -> 0.5 (applies from step 4)") == 1
    assert log.count("resume: trainer.max_epochs 1 -> 2 (applies from step 4)") == 1
    # The optimizer trained at the new lr: the checkpoint it saved holds it, and TensorBoard's
    # train/lr (from the real event files) is 0.05 before the resumed step and 0.5 after.
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert [g["lr"] for g in last["optimizer"]["param_groups"]] == [0.5]
    lrs = dict(read_scalars(run_dir / "tb")["train/lr"])
    assert [lrs[s] for s in (1, 2, 3, 4)] == pytest.approx([0.05] * 4)
    assert [lrs[s] for s in (5, 6, 7, 8)] == pytest.approx([0.5] * 4)
    record = read_metrics(run_dir)
    assert record["resume_changes"] == [
        {"key": "optimizer.lr", "from": 0.05, "to": 0.5, "step": 4},
        {"key": "trainer.max_epochs", "from": 1, "to": 2, "step": 4},
    ]
    # A second resume adds its own change after the first one's, and nothing for the keys
    # the checkpoint already has.
    code, text = run_cli_here([*TINY, "trainer.max_epochs=3", "optimizer.lr=0.5",
                               f"resume={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    assert read_metrics(run_dir)["resume_changes"] == [
        *record["resume_changes"], {"key": "trainer.max_epochs", "from": 2, "to": 3, "step": 8}]
    assert (run_dir / "ddpexp.log").read_text().count("resume: optimizer.lr") == 1


def test_a_changed_lr_under_a_schedule_scales_the_schedule_at_its_step(workdir, monkeypatch, capsys):
    # Cosine over 2 epochs (8 steps), stopped after the first 4 by max_steps: resumed with
    # lr 0.5, the next step's lr is 0.5 x the cosine factor at step 4, not 0.05 x it.
    sched = ["scheduler=cosine", "trainer.max_steps=4", "trainer.max_epochs=2"]
    run_dir = workdir / "outputs" / "run"
    code, text = run_cli_here([*TINY, *sched, f"hydra.run.dir={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    code, text = run_cli_here([*TINY, *sched[:1], "trainer.max_steps=null", "trainer.max_epochs=2",
                               "optimizer.lr=0.5", f"resume={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    lrs = dict(read_scalars(run_dir / "tb")["train/lr"])
    assert lrs[1] == pytest.approx(0.05)
    assert lrs[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)) / 2)  # step 5's lr
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["scheduler"]["base_lrs"] == [0.5]


def test_a_changed_model_is_refused_naming_the_key_and_nothing_is_written(workdir, monkeypatch,
                                                                          capsys):
    run_dir = _first_run(workdir, monkeypatch, capsys)
    before = _files(run_dir)
    code, text = run_cli_here([*TINY, "model.hidden=[16]", "optimizer.lr=0.5",
                               f"resume={run_dir}"], workdir, monkeypatch, capsys)
    assert code != 0
    assert "Traceback" not in text, text
    assert "model.hidden: [8] in the checkpoint, [16] now" in text
    assert "model.hidden=[8]" in text  # the fix
    assert "optimizer.lr" not in text  # what could be applied is not what refuses it
    assert _files(run_dir) == before  # no resume-N dir, no log line, the record as it was
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == [
        "config.yaml", "hydra.yaml", "overrides.yaml"]


def test_a_changed_seed_and_optimizer_class_are_refused(workdir, monkeypatch, capsys):
    run_dir = _first_run(workdir, monkeypatch, capsys)
    code, text = run_cli_here([*TINY, "seed=1", "optimizer=adam", f"resume={run_dir}"],
                              workdir, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text, text
    assert "seed: 0 in the checkpoint, 1 now (it reorders the data" in text
    assert "optimizer._target_: torch.optim.SGD in the checkpoint, torch.optim.Adam now" in text


def test_resume_auto_applies_a_change_too(workdir, monkeypatch, capsys):
    run_dir = _first_run(workdir, monkeypatch, capsys)
    code, text = run_cli_here([*TINY, "trainer.max_epochs=2", "optimizer.weight_decay=0.1",
                               "resume=auto", f"hydra.run.dir={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert [g["weight_decay"] for g in last["optimizer"]["param_groups"]] == [0.1]
    keys = [c["key"] for c in read_metrics(run_dir)["resume_changes"]]
    assert keys == ["optimizer.weight_decay", "trainer.max_epochs"]


def test_a_resume_that_names_no_key_keeps_the_runs_own_values(workdir, monkeypatch, capsys):
    # The run's own overrides (lr, epochs) are the base of a resume that names neither: no
    # "resume: optimizer.lr" line, and the optimizer trains on at the run's lr.
    run_dir = _first_run(workdir, monkeypatch, capsys, "optimizer.lr=0.2")
    code, text = run_cli_here(["trainer.max_epochs=2", f"resume={run_dir}"], workdir,
                              monkeypatch, capsys)
    assert code == 0, text
    log = (run_dir / "ddpexp.log").read_text()
    assert "resume: optimizer.lr" not in log and "resume: data." not in log
    assert read_metrics(run_dir)["resume_changes"] == [
        {"key": "trainer.max_epochs", "from": 1, "to": 2, "step": 4}]
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert [g["lr"] for g in last["optimizer"]["param_groups"]] == [0.2]
    assert last["step"] == 8  # two epochs of the run's own 4 steps (data.num_samples=32)
    # resume=auto into the run dir, and a resume from a checkpoint file, keep them as well;
    # each attempt records the whole set it ran with, so a chain of resumes keeps them too.
    code, text = run_cli_here(["trainer.max_epochs=3", "resume=auto",
                               f"hydra.run.dir={run_dir}"], workdir, monkeypatch, capsys)
    assert code == 0, text
    code, text = run_cli_here(["trainer.max_epochs=4",
                               f"resume={run_dir / 'checkpoints' / 'last.pt'}"], workdir,
                              monkeypatch, capsys)
    assert code == 0, text
    assert [c["key"] for c in read_metrics(run_dir)["resume_changes"]] == ["trainer.max_epochs"] * 3
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert [g["lr"] for g in last["optimizer"]["param_groups"]] == [0.2]
    assert last["step"] == 16
    assert "resume: optimizer.lr" not in (run_dir / "ddpexp.log").read_text()


def test_a_key_the_resume_names_still_changes_the_run(workdir, monkeypatch, capsys):
    # The resume's own key wins over the recorded one, and is applied and listed as before.
    run_dir = _first_run(workdir, monkeypatch, capsys, "optimizer.lr=0.2")
    code, text = run_cli_here(["trainer.max_epochs=2", "optimizer.lr=0.3", f"resume={run_dir}"],
                              workdir, monkeypatch, capsys)
    assert code == 0, text
    assert read_metrics(run_dir)["resume_changes"] == [
        {"key": "optimizer.lr", "from": 0.2, "to": 0.3, "step": 4},
        {"key": "trainer.max_epochs", "from": 1, "to": 2, "step": 4}]


def test_a_key_the_run_added_can_be_named_plainly_on_resume(workdir, monkeypatch, capsys):
    # The run's "+note=a" is recorded; "note=a" on the resume's command line names that key
    # as it now exists (no "+": it is there once the run's own override added it).
    run_dir = _first_run(workdir, monkeypatch, capsys, "+note=a")
    code, text = run_cli_here(["trainer.max_epochs=2", "note=a", f"resume={run_dir}"], workdir,
                              monkeypatch, capsys)
    assert code == 0, text
    assert read_metrics(run_dir)["resume_changes"] == [
        {"key": "trainer.max_epochs", "from": 1, "to": 2, "step": 4}]
