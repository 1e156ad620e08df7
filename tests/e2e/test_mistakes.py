"""Every mistake a user can make on the command line gets one message naming the key or file
and the fix, a non-zero exit and no traceback, and leaves nothing half-written behind.

Most cases run the real CLI entry point in this process (Hydra's ``main`` included), which
costs milliseconds instead of the seconds of a subprocess."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from helpers import run_cli_here, run_dirs

from ddpexp.config.cli import run_dir_conflict
from ddpexp.launch.failures import explain_os_error

# (overrides, what the one message must say)
MISTAKES = [
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 must be > 0"),
    (["trainer.grad_clip=0"], "trainer.grad_clip=0.0 must be > 0"),
    (["trainer.early_stop_patience=0"], "trainer.early_stop_patience=0 must be >= 1"),
    (["trainer.ckpt_every_steps=0"], "trainer.ckpt_every_steps=0 must be >= 1"),
    (["trainer.shutdown_grace_s=-1"], "trainer.shutdown_grace_s=-1 must be >= 0"),
    (["trainer.rdzv_timeout_s=0"], "trainer.rdzv_timeout_s=0 must be > 0"),
    (["seed=-1"], "seed=-1 must be >= 0"),
    (["optimizer.lr=-1"], "optimizer.lr=-1 must be >= 0"),
    (["data.batch_size=1.5"], "data.batch_size=1.5 must be >= 1, a whole number"),
    (["data.prefetch_factor=-1", "data.fast_path=false", "data.num_workers=1"],
     "data.prefetch_factor=-1 must be >= 1, a whole number, or null"),
    (["data.prefetch_factor=2"], "data.prefetch_factor=2 needs data.num_workers > 0"),
    (["hydra.run.dir=/proc/forbidden"], "cannot create the run dir /proc/forbidden"),
    (["model._target_=nope.Model"], "model._target_: cannot import nope.Model (no module named "
                                    "'nope'); check the dotted path"),
]


@pytest.mark.parametrize("overrides, message", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_each_mistake_gets_one_message(tmp_path, monkeypatch, capsys, overrides, message):
    code, text = run_cli_here(overrides, tmp_path, monkeypatch, capsys)
    assert code != 0
    assert message in text
    assert "Traceback" not in text
    # A config mistake leaves no run dir behind, nor the outputs/<date> made for it.
    assert run_dirs(tmp_path) == [] and not list(tmp_path.glob("outputs/*"))


PLUGINS = str(Path(__file__).parents[1] / "plugins")

# Mistakes only the data or the model reveal: caught on one batch before the first step.
BATCH_MISTAKES = [
    (["data.num_classes=5"], "the data has labels from 0 to 9, but the model outputs 5 classes "
                             "(data.num_classes). Set data.num_classes=10"),
    (["data.shape=[3,8,8]"], "data.shape=[3, 8, 8] but the samples of data ddpexp.data.Digits have "
                             "shape [1, 8, 8]; set data.shape=[1, 8, 8]"),
    (["model=mlp", "data.shape=[1,4,4]"], "set data.shape=[1, 8, 8]"),
    (["data=diabetes", "task=classification", "model=mlp"],
     "task=classification needs integer class labels, but the data gives torch.float32 labels"),
    (["model=mlp", "model._target_=faulty.TupleOut"], "the model returned tuple, not a tensor"),
    (["model=mlp", "model._target_=faulty.NoParams"], "without trainable parameters"),
]


@pytest.mark.parametrize("overrides, message", BATCH_MISTAKES,
                         ids=[" ".join(m[0]) for m in BATCH_MISTAKES])
def test_each_data_or_model_mistake_gets_one_message(tmp_path, monkeypatch, capsys, overrides, message):
    monkeypatch.syspath_prepend(PLUGINS)
    code, text = run_cli_here([*overrides, "trainer.max_epochs=1"], tmp_path, monkeypatch, capsys)
    assert code != 0
    assert message in text
    assert "Traceback" not in text and "epoch 0" not in text  # before the first step
    assert "Error executing job" not in text
    assert run_dirs(tmp_path) == []  # found before the first step: no run dir left
    assert not list(tmp_path.glob("outputs/*"))


# Mistakes found after Hydra has composed the config (by the task, a callback, a logger),
# and typos of entries Hydra would "fix" by adding a bogus one.
LATE_MISTAKES = [
    (["task.metrics=[nonsense]"], "task.metrics: nonsense is not a metric of task=classification"),
    (["callbacks.early_stopping.patience=0", "trainer.max_epochs=1"], "callbacks.early_stopping"),
    (["callbacks.early_stoping.patience=3"],
     "unknown entry callbacks.early_stoping: did you mean callbacks.early_stopping?\n(callbacks: "),
    (["callbacks.early_stopping.patiense=3"],
     "unknown key callbacks.early_stopping.patiense: did you mean callbacks.early_stopping.patience?"),
    (["~callbacks.emma"], "unknown entry callbacks.emma: did you mean callbacks.ema?"),
    (["logger.tensorbord.flush_secs=5"], "unknown entry logger.tensorbord: did you mean logger.tensorboard?"),
    # Typos of group names, top-level keys and the keys of a node built by its _target_.
    (["modle=mlp"], "unknown group or key modle: did you mean model=mlp?\n(groups: "),
    (["seeed=3"], "unknown group or key seeed: did you mean seed=3?"),
    (["model.hiden=[64]"], "unknown key model.hiden: did you mean model.hidden?\n(model: "),
    # Hydra's advice for the typo above, followed: refused before any worker starts.
    (["+model.hiden=[64]"], "model.hiden: ddpexp.models.MLP takes no argument hiden; did you mean "
                            "model.hidden? (ddpexp.models.MLP takes: input_shape, num_classes, "
                            "hidden, dropout)"),
]


@pytest.mark.parametrize("overrides, message", LATE_MISTAKES, ids=[" ".join(m[0]) for m in LATE_MISTAKES])
def test_a_mistake_found_before_the_first_step_is_only_ddpexps_message(tmp_path, monkeypatch, capsys,
                                                                       overrides, message):
    """Also with a fixed hydra.run.dir: the same command, corrected, then runs there (not
    refused as a dir that holds a run)."""
    args = ["model=mlp", "trainer.max_epochs=1", "hydra.run.dir=outputs/fixed"]
    code, text = run_cli_here([*args, *overrides], tmp_path, monkeypatch, capsys)
    assert code != 0 and message in text, text
    assert "Error executing job" not in text and "Traceback" not in text
    assert "+callbacks.early_stoping" not in text and "not in struct" not in text
    assert not (tmp_path / "outputs" / "fixed").exists() and run_dirs(tmp_path) == []
    if message.startswith("unknown"):
        return  # refused before Hydra made a run dir
    code, text = run_cli_here([*args, "trainer.max_steps=2", "trainer.test=false"], tmp_path,
                              monkeypatch, capsys)
    assert code == 0, text


def test_a_sweep_jobs_mistake_stays_in_its_dir_and_row(tmp_path, monkeypatch, capsys):
    code, text = run_cli_here(["-m", "hydra/launcher=basic", "model=mlp", "task.metrics=[nonsense]",
                               "hydra.sweep.dir=sweep"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "nonsense is not a metric" in text
    metrics = json.loads((tmp_path / "sweep" / "0" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "nonsense is not a metric" in metrics["error"]
    assert "nonsense is not a metric" in (tmp_path / "sweep" / "summary.csv").read_text()


@pytest.mark.skipif(os.geteuid() == 0, reason="permissions do not stop root")
def test_an_unreadable_data_root_is_one_message(tmp_path, monkeypatch, capsys):
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    raw.chmod(0)
    try:
        code, text = run_cli_here(["data=mnist", f"data.root={tmp_path / 'data'}"], tmp_path,
                                  monkeypatch, capsys)
    finally:
        raw.chmod(0o755)
    assert code != 0 and "Traceback" not in text
    assert f"permission denied: {raw}" in text and "point data.root at a place" in text


def _a_run(run_dir: Path) -> Path:
    """A dir that holds a finished run, as the trainer leaves it."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"weights")
    (run_dir / "metrics.json").write_text(json.dumps({"status": "completed"}))
    (run_dir / "ddpexp.log").write_text("log\n")
    return run_dir


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_an_existing_run_dir_is_not_overwritten(tmp_path, monkeypatch, capsys):
    run_dir = _a_run(tmp_path / "old")
    before = _snapshot(run_dir)
    code, text = run_cli_here([f"hydra.run.dir={run_dir}", "model=mlp"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text
    assert f"hydra.run.dir={run_dir} already holds a run" in text
    assert f"resume={run_dir}" in text and "overwrite=true" in text
    assert _snapshot(run_dir) == before  # nothing written, not even Hydra's config
    # resume= says what to do with it; a sweep dir is guarded the same way.
    assert run_dir_conflict([f"hydra.run.dir={run_dir}", f"resume={run_dir}"]) is None
    assert run_dir_conflict(["-m", f"hydra.sweep.dir={tmp_path}", "seed=1,2"]).startswith(
        f"hydra.sweep.dir={tmp_path} already holds 1 run(s) of an earlier sweep")
    assert run_dir_conflict(["-m", f"hydra.sweep.dir={tmp_path}", "resume=auto"]) is None


def test_overwrite_true_starts_the_run_over(tmp_path, monkeypatch, capsys):
    run_dir = _a_run(tmp_path / "old")
    (run_dir / "notes.txt").write_text("mine")  # not a run output: kept
    code, text = run_cli_here([f"hydra.run.dir={run_dir}", "overwrite=true", "model=mlp",
                           "trainer.max_epochs=1"], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["epochs"] == 1
    assert not (run_dir / ".hydra" / "resume-1").exists()  # a fresh run, not a resume
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() != b"weights"
    assert (run_dir / "notes.txt").read_text() == "mine"
    assert "log\n" not in (run_dir / "ddpexp.log").read_text()[:4]


@pytest.mark.parametrize("code, says", [
    (errno.ENOSPC, "no space left on the device that holds {f}. Free some space there, or point data.root"),
    (errno.EACCES, "permission denied: {f}. Give this user access to it, or point data.root"),
    (errno.EROFS, "{f} is on a read-only file system; point data.root"),
])
def test_os_errors_name_the_file_and_the_key(tmp_path, code, says):
    name = str(tmp_path / "data" / "MNIST" / "raw" / "x")
    err = explain_os_error(OSError(code, os.strerror(code), name), data_root=str(tmp_path / "data"),
                           run_dir=str(tmp_path / "run"))
    assert says.format(f=name) in str(err)
    in_run = explain_os_error(OSError(code, os.strerror(code), str(tmp_path / "run" / "metrics.json")),
                              data_root=str(tmp_path / "data"), run_dir=str(tmp_path / "run"))
    assert "hydra.run.dir" in str(in_run)


def test_report_skips_a_malformed_metrics_file_and_says_so(tmp_path, capsys):
    from ddpexp import report

    for job, content in (("0", json.dumps({"status": "completed", "monitor": "val/acc",
                                          "best": {"val/acc": 0.9}, "final": [1]})),
                         ("1", "[1, 2]")):
        (tmp_path / job).mkdir()
        (tmp_path / job / "metrics.json").write_text(content)
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "note: run 1 skipped:" in out.err and "holds a JSON list" in out.err
    rows = {r.job: r for r in report.collect(tmp_path)}
    assert rows["0"].best == 0.9 and rows["0"].final is None and rows["1"].status == "unreadable"
    # --plot to a place that cannot be written: one message, exit 1.
    assert report.main([str(tmp_path), "--plot", "/proc/nowhere/curves.png"]) == 1
    err = capsys.readouterr().err
    assert "--plot /proc/nowhere/curves.png: cannot write it" in err and "Traceback" not in err


def test_workers_that_cannot_fit_in_memory_are_refused(tmp_path, monkeypatch, capsys, caplog):
    from ddpexp.errors import ConfigError
    from ddpexp.launch.fanout import Plan
    from ddpexp.launch.resources import check_resources

    with pytest.raises(ConfigError, match=r"trainer.procs=64 starts 64 worker processes, at least "
                                          r"18.8 GiB .* but 8.0 GiB is available; use trainer.procs=27"):
        check_resources(Plan("ddp", 64, 1, 0), available=8 * 2**30, cores=2)
    with caplog.at_level("WARNING", logger="ddpexp"):
        check_resources(Plan("ddp", 4, 1, 0), available=64 * 2**30, cores=2)
    assert "trainer.procs=4 CPU workers on 2 core(s)" in caplog.text
    # Through the CLI, before any worker starts.
    code, text = run_cli_here(["trainer.procs=100000"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "trainer.procs=100000 starts 100000 worker processes" in text
    assert "Traceback" not in text and run_dirs(tmp_path) == []


def test_unused_parameters_name_the_key_that_allows_them(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(PLUGINS)
    # One DDP worker (in this process) behaves as several would.
    args = ["model=mlp", "model._target_=faulty.Unused", "trainer.strategy=ddp", "trainer.max_epochs=1"]
    for sub in "ab":
        (tmp_path / sub).mkdir()
    code, text = run_cli_here(args, tmp_path / "a", monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text
    assert "Set trainer.find_unused_parameters=true" in text
    code, text = run_cli_here([*args, "trainer.find_unused_parameters=true"], tmp_path / "b",
                              monkeypatch, capsys)
    assert code == 0, text
    (run_dir,) = run_dirs(tmp_path / "b")
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"


def test_an_error_of_the_one_worker_in_this_process_is_said_as_under_ddp(tmp_path, monkeypatch, capsys):
    """What torch elastic's agent reports of a failed worker, the in-process path says too:
    one message naming the rank and the cause, the traceback in the log, a failed record."""
    monkeypatch.syspath_prepend(PLUGINS)
    code, text = run_cli_here(["model=mlp", "model._target_=faulty.Faulty", "+model.rank=0",
                               "trainer.max_epochs=1"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text and "Error executing job" not in text
    assert "a worker failed, so the whole run was stopped:\n  rank 0 (pid " in text
    assert "raised RuntimeError: injected failure on rank 0" in text
    (run_dir,) = run_dirs(tmp_path)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "injected failure on rank 0" in metrics["error"]
    assert "Traceback" in (run_dir / "ddpexp.log").read_text()


def test_max_parallel_below_one_is_refused_before_the_sweep_writes(tmp_path, monkeypatch, capsys):
    """On the command line (before Hydra starts) and from a config file (by the launcher):
    it used to run the jobs one at a time without a word."""
    says = ("hydra.launcher.max_parallel={n} must be >= 1 (K jobs at once, each on its own slice "
            "of the machine), or null (as many at once as the machine holds)")
    code, text = run_cli_here(["-m", "hydra.launcher.max_parallel=0", "seed=0,1"], tmp_path,
                              monkeypatch, capsys)
    assert code == 1 and text.strip() == says.format(n=0)
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "wide.yaml").write_text("# @package _global_\nhydra:\n  launcher:\n    max_parallel: -2\n")
    code, text = run_cli_here(["-m", "--config-dir", str(tmp_path / "conf"), "experiment=wide",
                               "seed=0,1"], tmp_path, monkeypatch, capsys)
    assert code == 1 and says.format(n=-2) in text and "Traceback" not in text
    assert not (tmp_path / "outputs").exists()
