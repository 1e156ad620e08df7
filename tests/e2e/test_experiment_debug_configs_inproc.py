"""The ``experiment`` and ``debug`` config groups in this process: the shipped recipes are
there and set what they promise, each trains a few steps under ``debug=fast``, and the trainer
keys behind the debug configs (limits, overfit, profile, anomaly) with their bad values."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from helpers import build_trainer, compose_config, read_scalars, write_cifar10, write_mnist
from torch import nn

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "src" / "ddpexp" / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
DEBUGS = sorted(p.stem for p in (CONF / "debug").glob("*.yaml"))


def test_the_shipped_recipes_and_debug_configs_are_there():
    assert {"digits_convnet", "diabetes_mlp", "char_gpt", "mnist_convnet",
            "cifar10_resnet18"} <= set(EXPERIMENTS)
    assert {"fast", "overfit", "anomaly", "profile"} <= set(DEBUGS)
    for group in ("experiment", "debug"):
        for path in (CONF / group).glob("*.yaml"):
            assert path.read_text().startswith("# @package _global_\n"), path


def test_recipes_set_what_they_promise():
    cifar = compose_config("experiment=cifar10_resnet18")
    assert cifar["model"]["_target_"] == "ddpexp.models.resnet18"
    assert cifar["optimizer"]["_target_"] == "torch.optim.SGD"
    assert (cifar["optimizer"]["lr"], cifar["optimizer"]["momentum"],
            cifar["optimizer"]["weight_decay"]) == (0.1, 0.9, 5e-4)
    assert cifar["scheduler"]["_target_"] == "ddpexp.schedulers.cosine"
    assert [t["_target_"].rsplit(".", 1)[1] for t in cifar["data"]["train_transform"]] == \
        ["RandomCrop", "RandomHorizontalFlip"]
    assert cifar["trainer"]["precision"] == "bf16" and cifar["trainer"]["channels_last"] is True
    default = compose_config()
    explicit = compose_config("experiment=digits_convnet")
    assert explicit == default  # the default run, made explicit
    # The command line wins over the recipe, and debug over the recipe.
    over = compose_config("experiment=cifar10_resnet18", "debug=fast", "optimizer.lr=0.05")
    assert over["optimizer"]["lr"] == 0.05 and over["trainer"]["max_epochs"] == 1


def _recipe_args(name: str, tmp_path: Path) -> list[str]:
    """What each recipe needs on this machine: its data, and a small batch for the big ones."""
    if name == "mnist_convnet":
        write_mnist(tmp_path / "data", n_train=16, n_test=8)
        return [f"data.root={tmp_path / 'data'}", "data.batch_size=4"]
    if name == "cifar10_resnet18":
        write_cifar10(tmp_path / "data", per_batch=4)
        return [f"data.root={tmp_path / 'data'}", "data.verify=false", "data.batch_size=4",
                "data.num_workers=0"]
    if name == "char_gpt":
        return [f"data.path={REPO / 'README.md'}", "data.batch_size=8"]
    return []


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_runs_a_few_steps_with_debug_fast(tmp_path, name):
    trainer = build_trainer(tmp_path / "run", [f"experiment={name}", "debug=fast",
                                               *_recipe_args(name, tmp_path)])
    result = trainer.fit()
    assert result["status"] == "completed", result
    assert (result["epochs"], result["steps"]) == (1, 2)  # 2 batches of one epoch
    assert math.isfinite(result["final"][result["monitor"]])
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_limits_count_batches_per_worker(tmp_path):
    trainer = build_trainer(tmp_path, ["trainer.limit_train_batches=3", "trainer.limit_val_batches=2",
                                       "trainer.max_epochs=2", "data.batch_size=16"])
    seen = []
    trainer.val_loader = _Counting(trainer.val_loader, seen)
    result = trainer.fit()
    assert result["steps"] == 6
    assert seen == [2, 2]  # two validation batches at each of the two epoch ends


def test_the_test_line_counts_the_samples_evaluated(tmp_path, caplog):
    # debug=fast evaluates 2 batches: 100 of the digits' 180 test samples.
    trainer = build_trainer(tmp_path, ["debug=fast", "data.batch_size=50"])
    with caplog.at_level("INFO", logger="ddpexp"):
        trainer.fit()
    assert "test (best.pt, epoch 0, 100 samples)" in caplog.text
    assert trainer.evaluate_checkpoint(tmp_path / "checkpoints" / "best.pt")["samples"] == 100
    trainer.t.limit_val_batches = None  # the whole split
    assert trainer.evaluate_checkpoint(tmp_path / "checkpoints" / "best.pt")["samples"] == 180


class _Counting:
    """A loader that records how many batches each pass over it yielded."""

    def __init__(self, loader, record: list):
        self.loader, self.record = loader, record

    def __iter__(self):
        n = 0
        for batch in self.loader:
            n += 1
            yield batch
        self.record.append(n)

    def __len__(self):
        return len(self.loader)


def test_overfit_drives_the_loss_of_two_batches_near_zero(tmp_path):
    trainer = build_trainer(tmp_path, ["debug=overfit", "trainer.max_epochs=30",
                                       "trainer.log_every_n_steps=2"])
    result = trainer.fit()
    train_loss = read_scalars(tmp_path / "tb")["train/loss"]
    assert result["steps"] == 2 * 30  # 2 batches an epoch
    assert train_loss[0][1] > 1.0  # it started from chance (10 classes)
    assert train_loss[-1][1] < 0.01, train_loss[-5:]
    # validation ran on the same two (training) batches
    assert result["final"]["val/loss"] < 0.01 and result["final"]["val/acc"] == 1.0


def test_profile_writes_a_trace_and_logs_the_top_operators(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ddpexp"):
        result = build_trainer(tmp_path, ["debug=profile"]).fit()
    assert result["status"] == "completed"
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any(str(n).startswith("aten::convolution") for n in names)
    assert "top operators by self cpu time total" in caplog.text
    assert "ProfilerStep#" in json.dumps(trace)  # the steps are marked in the trace


class FlagRecorder(nn.Module):
    """A tiny classifier that records the debug modes torch is in at each forward."""

    seen: list[tuple[bool, bool]] = []

    def __init__(self, input_shape, num_classes, **unused):
        super().__init__()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)

    def forward(self, x):
        FlagRecorder.seen.append((torch.is_anomaly_enabled(), torch.are_deterministic_algorithms_enabled()))
        return self.fc(x.flatten(1))


def test_anomaly_turns_on_detection_and_determinism_and_restores_them(tmp_path):
    FlagRecorder.seen.clear()
    trainer = build_trainer(tmp_path, ["debug=anomaly", "trainer.limit_train_batches=2",
                                       "trainer.limit_val_batches=1",
                                       f"model._target_={__name__}.FlagRecorder"])
    # Building the trainer checks the task and data on a batch, before the run's modes.
    assert FlagRecorder.seen and set(FlagRecorder.seen) == {(False, False)}
    FlagRecorder.seen.clear()
    result = trainer.fit()
    assert result["status"] == "completed"
    # 2 training steps, 1 validation batch and the test split all ran in both modes.
    assert len(FlagRecorder.seen) > 3 and all(f == (True, True) for f in FlagRecorder.seen)
    assert not torch.is_anomaly_enabled() and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("override, message", [
    ("trainer.save_top_k=0", r"trainer.save_top_k=0 must be >= 1 \(or null\)"),
    ("trainer.limit_train_batches=0", r"trainer.limit_train_batches=0 must be >= 1 \(or null\)"),
    ("trainer.overfit_batches=-1", r"trainer.overfit_batches=-1 must be >= 1 \(or null\)"),
    ("trainer.ema_decay=1.0", r"trainer.ema_decay=1.0 must be in \[0, 1\)"),
])
def test_bad_values_of_the_new_keys_are_named(override, message):
    from omegaconf import OmegaConf

    from ddpexp.config.validate import validate
    from ddpexp.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(OmegaConf.create(compose_config(override)))


def test_a_debug_run_leaves_only_its_own_dir(tmp_path, monkeypatch, capsys):
    """debug=* moves runs to outputs/debug/; the default outputs/<date>/<time> that composing
    that override resolved once is not left behind, empty."""
    from helpers import run_cli_here

    code, text = run_cli_here(["debug=fast", "model=mlp", "trainer.test=false"], tmp_path,
                              monkeypatch, capsys)
    assert code == 0, text
    (date,) = (tmp_path / "outputs" / "debug").iterdir()
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["debug"]
    assert len(list(date.iterdir())) == 1
