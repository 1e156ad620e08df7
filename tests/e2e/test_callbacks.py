"""The callbacks seam: a user's own callback from their config dir under DDP (its scalar in
every logger, its state through SIGTERM and resume, a stop asked by one rank), the built-in
features as removable callbacks whose state survives a resume, the order of the events, and
one message for each kind of bad entry."""

from __future__ import annotations

import csv
import signal
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import (assert_same_tensors, build_trainer, read_metrics, read_scalars, run_cli,
                     run_cli_here, session_pids, start_cli)
from test_checkpoint_signals import check_interrupted, interrupt

import ddpexp
from ddpexp.callbacks import Callback, Dispatch

ARGS = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "trainer.log_every_n_steps=2",
]

PROBE = '''
import ddpexp


class Probe(ddpexp.Callback):
    """Counts optimizer steps (state a resume must keep), logs the count each epoch, and can
    ask for a stop from one rank only."""

    def __init__(self, stop_rank=None, stop_step=None):
        self.stop_rank, self.stop_step = stop_rank, stop_step
        self.steps = 0

    def on_train_batch_end(self, trainer):
        self.steps += 1
        if trainer.rank == self.stop_rank and trainer.step == self.stop_step:
            trainer.request_stop(f"probe asked at step {trainer.step}")

    def on_train_epoch_end(self, trainer, metrics):
        trainer.log_metrics({"probe/steps": self.steps, "probe/twice_val_loss": 2 * metrics["val/loss"]})

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]
'''


@pytest.fixture
def user_conf(tmp_path: Path) -> tuple[Path, dict]:
    """A user's config dir holding their callback's module and a callbacks option that adds
    it to the defaults; the environment that puts the module on the path."""
    conf = tmp_path / "my_conf"
    (conf / "callbacks").mkdir(parents=True)
    (conf / "probe_cb.py").write_text(PROBE)
    (conf / "callbacks" / "with_probe.yaml").write_text(textwrap.dedent("""\
        defaults:
          - default
        probe:
          _target_: probe_cb.Probe
        """))
    return conf, {"PYTHONPATH": str(conf)}


def user_args(conf: Path) -> list[str]:
    return ["--config-dir", str(conf), *ARGS, "callbacks=with_probe", "logger=[tensorboard,csv]",
            "trainer.procs=2"]


def csv_points(run_dir: Path, name: str) -> list[tuple[int, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(f) if r["name"] == name]


@pytest.mark.slow
def test_user_callback_under_ddp_logs_and_keeps_its_state_through_sigterm(workdir, user_conf):
    conf, env = user_conf
    args = user_args(conf)
    run_dir, res, took = interrupt(workdir, [*args, "trainer.ckpt_every_steps=3"], signal.SIGTERM, env=env)
    ckpt = check_interrupted(run_dir, res, took, "SIGTERM")
    assert ckpt["callbacks"]["probe"]["steps"] == ckpt["step"]  # saved where the run stopped
    length = f"trainer.max_epochs={ckpt['epoch'] + 2}"
    run_cli([*args, "trainer.ckpt_every_steps=3", length, f"resume={run_dir}"], workdir, env=env)
    reference = workdir / "outputs" / "reference"
    run_cli([*args, "trainer.ckpt_every_steps=3", length, f"hydra.run.dir={reference}"], workdir, env=env)
    a = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    b = torch.load(reference / "checkpoints/last.pt", weights_only=True)
    for key in ("model", "optimizer", "step", "callbacks"):
        assert_same_tensors(a[key], b[key], key)
    assert a["callbacks"]["probe"]["steps"] == a["step"]  # not restarted at the resume
    # The callback's scalar, in TensorBoard and metrics.csv, each step once, as uninterrupted.
    for read in (lambda d: read_scalars(d / "tb")["probe/steps"], lambda d: csv_points(d, "probe/steps")):
        got, want = read(run_dir), read(reference)
        assert got == want and [s for s, _ in got] == sorted({s for s, _ in got})
        assert got[-1] == (a["step"], float(a["step"]))


@pytest.mark.slow
def test_a_stop_asked_by_rank_one_alone_ends_every_rank(workdir, user_conf):
    conf, env = user_conf
    proc = start_cli([*user_args(conf), "trainer.max_epochs=50", "+callbacks.probe.stop_rank=1",
                      "+callbacks.probe.stop_step=3"], workdir, env)
    from helpers import finish, only_run_dir

    res = finish(proc, 120)
    assert not res.leftovers and not session_pids(proc.pid)
    assert res.returncode == 0, res.output
    run_dir = only_run_dir(workdir)
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "stopped"
    assert "rank 1: probe asked at step 3" in metrics["stop_reason"]
    # Asked at step 3 of the first epoch (6 steps per rank): agreed at the next log step,
    # validated, checkpointed, ended; the epoch never finished.
    assert metrics["steps"] == 4 and metrics["epochs"] == 0
    assert torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["step"] == 4
    assert "stop requested (rank 1: probe asked at step 3)" in res.output
    assert "test/acc" in metrics["test"]


def test_early_stopping_counter_survives_a_resume(tmp_path):
    """With lr=0 nothing improves after epoch 0: patience 3 stops after epoch 3. A run
    stopped after epoch 1 and resumed must stop there too (a counter restarted at the resume
    would run two epochs longer)."""
    args = [*ARGS, "optimizer.lr=0", "trainer.early_stop_patience=3", "trainer.test=false"]
    whole = build_trainer(tmp_path / "whole", [*args, "trainer.max_epochs=10"]).fit()
    assert whole["status"] == "early_stopped" and whole["epochs"] == 4
    first = build_trainer(tmp_path / "part", [*args, "trainer.max_epochs=2"]).fit()
    assert first["status"] == "completed"
    last = tmp_path / "part/checkpoints/last.pt"
    assert torch.load(last, weights_only=True)["callbacks"]["early_stopping"]["bad_epochs"] == 1
    resumed = build_trainer(tmp_path / "part", [*args, "trainer.max_epochs=10"]).fit(resume_from=last)
    assert (resumed["status"], resumed["epochs"]) == ("early_stopped", 4)


def test_removing_a_default_callback(tmp_path):
    with_ema = build_trainer(tmp_path / "a", [*ARGS, "trainer.ema_decay=0.9"])
    without = build_trainer(tmp_path / "b", [*ARGS, "trainer.ema_decay=0.9", "~callbacks.ema"])
    assert "ema" in dict(with_ema.callbacks) and "ema" not in dict(without.callbacks)
    without.fit()
    assert "raw_model" not in torch.load(tmp_path / "b/checkpoints/best.pt", weights_only=True)
    # A callback whose key is null is left out of the run altogether: nothing fires for it.
    names = dict(build_trainer(tmp_path / "c", ARGS).callbacks)
    assert {"checkpoint", "lr_monitor"} <= set(names) and not {"ema", "early_stopping"} & set(names)


def _recording(event: str):
    def method(self, trainer, *args):
        self.log.append((self.name, event, trainer.epoch, trainer.step))
    return method


class Recorder(Callback):
    """Records every event it sees, with the trainer's epoch and step at that moment."""

    def __init__(self, name: str, log: list, order: int = 0):
        self.name, self.log, self.order = name, log, order


for _event in ddpexp.callbacks.EVENTS:
    setattr(Recorder, _event, _recording(_event))


def test_events_fire_in_order_and_callbacks_by_their_order(tmp_path):
    log: list = []
    trainer = build_trainer(tmp_path, [*ARGS, "trainer.max_epochs=2", "trainer.test=false",
                                       "data.batch_size=48", "trainer.log_every_n_steps=1"])
    assert trainer.batches_per_epoch == 2
    recorders = {"late": Recorder("late", log, order=5), "early": Recorder("early", log, order=-5),
                 "mid": Recorder("mid", log)}
    trainer.callbacks = Dispatch({**dict(trainer.callbacks), **recorders})
    result = trainer.fit()
    mine = [(n, e, ep, st) for n, e, ep, st in log if n == "mid" and e != "setup"]
    events = [e for _, e, _, _ in mine]
    per_epoch = ["on_train_epoch_start", *["on_before_optimizer_step", "on_train_batch_end"] * 2,
                 "on_validation_start", "on_validation_end", "on_train_epoch_end",
                 "on_save_checkpoint"]  # the checkpoint callback runs last, and saves
    assert events == ["on_fit_start", *per_epoch, *per_epoch, "on_fit_end"], events
    # At every event the three run early, mid, late.
    assert [n for n, *_ in log[:3]] == ["early", "mid", "late"]
    # on_train_batch_end sees the step already counted; epoch end still sees its own epoch.
    assert ("mid", "on_train_batch_end", 0, 1) in mine and ("mid", "on_train_epoch_end", 1, 4) in mine
    assert result["status"] == "completed" and result["steps"] == 4


@pytest.mark.parametrize("entry, message", [
    (["+callbacks.bad.every=3"], "callbacks.bad has no _target_"),
    (["+callbacks.bad._target_=no_such_module.Thing"], "callbacks.bad._target_=no_such_module.Thing does not import"),
    (["+callbacks.bad._target_=collections.OrderedDict"], "is not a subclass of ddpexp.Callback"),
])
def test_a_bad_callback_entry_is_one_message_before_any_worker(workdir, monkeypatch, capsys, entry, message):
    code, out = run_cli_here([*ARGS, "trainer.max_epochs=1", *entry], workdir, monkeypatch, capsys)
    assert code != 0 and message in out, out
    assert "Traceback" not in out and out.count(message) == 1
    assert not list(workdir.glob("outputs/**/metrics.json"))  # nothing ran


class Counter(Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, trainer):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_a_state_without_its_callback_and_a_callback_without_state_are_one_warning_each(tmp_path, caplog):
    args = [*ARGS, "trainer.max_epochs=1", "trainer.test=false"]
    first = build_trainer(tmp_path, args)
    first.callbacks = Dispatch({**dict(first.callbacks), "counter": Counter()})
    first.fit()
    last = tmp_path / "checkpoints/last.pt"
    assert torch.load(last, weights_only=True)["callbacks"]["counter"] == {"steps": first.step}
    again = build_trainer(tmp_path, [*args, "trainer.max_epochs=2"])
    again.callbacks = Dispatch({**dict(again.callbacks), "other": Counter()})
    with caplog.at_level("WARNING", logger="ddpexp"):
        again.fit(resume_from=last)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings.count("callbacks.other has no state in the checkpoint: it starts afresh") == 1
    assert warnings.count("the checkpoint holds the state of callbacks counter, which this run "
                          "does not have: ignored") == 1
    assert dict(again.callbacks)["other"].steps == again.step - first.step
