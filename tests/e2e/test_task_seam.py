"""The task seam: built-in tasks (classification, regression, language modelling) and a
user's own task and data from a config dir of their own, with every ddpexp guarantee."""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_tensors,
    build_trainer,
    compose_config,
    read_metrics,
    read_scalars,
    run_cli,
    run_dirs,
)

from ddpexp import Task
from ddpexp.errors import ConfigError
from ddpexp.task import Classification, as_task

# A user's own task and data, as they would write them: dict batches, a custom metric
# ("within": the share of predictions within 0.5 of the target), a model built with no
# arguments, and a monitor of the task's own.
USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    import ddpexp


    class Points(Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randn(n, 3, generator=g)
            self.y = self.x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=g)

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"inputs": {"x": self.x[i]}, "target": self.y[i]}


    class PointsData(ddpexp.data.DataSource):
        def load(self):
            return Points(90, 1), Points(37, 2), Points(23, 3)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x).squeeze(-1)


    class WithinTask(ddpexp.Task):
        monitor = "val/within"
        monitor_mode = "max"

        def training_step(self, model, batch):
            pred = model(batch["inputs"]["x"])
            err = pred - batch["target"]
            return {"loss": err.pow(2).mean(), "within": (err.detach().abs() < 0.5).float().mean()}

        def batch_size(self, batch):
            return len(batch["target"])


    class PlainClassification:
        """A task as the contract allows it: no base class, only a training step."""

        def training_step(self, model, batch):
            x, y = batch
            return {"loss": torch.nn.functional.cross_entropy(model(x), y)}
''')


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A user's package (module ``usertask``) and config dir (``my_conf``) in ``tmp_path``."""
    (tmp_path / "usertask.py").write_text(USER_MODULE)
    conf = tmp_path / "my_conf"
    for group, body in {
        "task/within.yaml": "_target_: usertask.WithinTask\n",
        "data/points.yaml": "_target_: usertask.PointsData\nbatch_size: 8\nnum_workers: 0\n",
        "model/net.yaml": "_target_: usertask.Net\n",
        "task/plain.yaml": "_target_: usertask.PlainClassification\n",
    }.items():
        (conf / group).parent.mkdir(parents=True, exist_ok=True)
        (conf / group).write_text(body)
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("usertask", None)


USER = ["task=within", "data=points", "model=net", "optimizer.lr=0.05"]


def test_default_run_still_classifies_digits(tmp_path: Path):
    trainer = build_trainer(tmp_path / "run")
    result = trainer.fit()
    assert result["monitor"] == "val/acc" and result["monitor_mode"] == "max"
    assert set(result["final"]) == {"val/loss", "val/acc"}
    assert result["best"]["val/acc"] >= 0.97


def test_regression_picks_best_at_lowest_val_mse(tmp_path: Path):
    run = tmp_path / "run"
    trainer = build_trainer(run, ["task=regression", "data=diabetes", "model=mlp",
                                  "model.hidden=[32]", "trainer.max_epochs=8", "optimizer.lr=0.02"])
    result = trainer.fit()
    mses = [h["val/mse"] for h in result["history"]]
    assert {"val/mse", "val/mae", "val/loss"} <= set(result["final"])
    assert result["monitor"] == "val/mse" and result["monitor_mode"] == "min"
    assert mses[-1] < mses[0]
    best_epoch = min(range(len(mses)), key=mses.__getitem__)
    assert result["best"] == {"val/mse": mses[best_epoch], "epoch": best_epoch}
    best = torch.load(run / "checkpoints/best.pt", weights_only=True)
    assert best["best"]["value"] == min(mses) and best["metrics"]["val/mse"] == min(mses)


def test_unknown_monitor_names_what_the_task_returns(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"trainer.monitor=val/f1 is not a metric of the task "
                                          r"\(Classification\); it returns val/loss, val/acc"):
        build_trainer(tmp_path / "run", ["trainer.monitor=val/f1"])


def test_user_task_accumulation_equals_one_big_batch(user_dir: Path, tmp_path: Path):
    """2 micro-batches of 8 give the weights of one batch of 16, with dict batches, an uneven
    last batch (90 samples) and the task's own batch_size()."""
    conf = user_dir / "my_conf"
    a = build_trainer(tmp_path / "a", [*USER, "data.batch_size=8", "trainer.accumulate=2",
                                       "trainer.max_epochs=2"], config_dir=conf)
    b = build_trainer(tmp_path / "b", [*USER, "data.batch_size=16", "trainer.max_epochs=2"],
                      config_dir=conf)
    ra, rb = a.fit(), b.fit()
    assert ra["steps"] == rb["steps"] == 12
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters(), strict=False):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)
    assert ra["final"]["val/within"] == pytest.approx(rb["final"]["val/within"])
    assert ra["monitor"] == "val/within" and ra["monitor_mode"] == "max"


def test_model_built_without_arguments_plugs_in(user_dir: Path, tmp_path: Path):
    plain = compose_config(*USER, config_dir=user_dir / "my_conf")
    assert plain["model"] == {"_target_": "usertask.Net"}


@pytest.mark.slow
def test_user_task_in_a_ddp_sweep_reaches_every_output(user_dir: Path):
    """Two DDP workers with accumulation, in a 2-job sweep: the task's own metric is in each
    job's metrics.json and TensorBoard, in summary.csv and in ddpexp.report."""
    env = {"PYTHONPATH": os.pathsep.join([str(user_dir), os.environ.get("PYTHONPATH", "")])}
    res = run_cli(["-m", "--config-dir", str(user_dir / "my_conf"), *USER[:-1],
                   "optimizer.lr=0.02,0.05", "trainer.procs=2", "trainer.accumulate=2",
                   "trainer.max_epochs=2", "trainer.log_every_n_steps=2"],
                  user_dir, timeout=240, env=env)
    (sweep,) = {d.parent for d in run_dirs(user_dir / "outputs")}
    for job in ("0", "1"):
        m = read_metrics(sweep / job)
        assert m["status"] == "completed" and m["world_size"] == 2
        assert m["monitor"] == "val/within" and 0.0 <= m["best"]["val/within"] <= 1.0
        scalars = read_scalars(sweep / job / "tb")
        assert {"train/within", "train/loss", "val/within", "val/loss", "best/val/within"} <= set(scalars)
        assert scalars["val/within"][-1][1] == pytest.approx(m["final"]["val/within"])
    import csv

    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    for r in rows:
        assert float(r["val/within"]) == pytest.approx(read_metrics(Path(r["dir"]))["final"]["val/within"])
    assert "best val/within" in res.stdout
    from ddpexp import report

    out = io.StringIO()
    with redirect_stdout(out):
        assert report.main([str(sweep), "--format", "json"]) == 0
    parsed = json.loads(out.getvalue())
    assert {r["monitor"] for r in parsed} == {"val/within"} and all("val/within" in r for r in parsed)


class OnlyTrainingStep:
    def training_step(self, model, batch):
        x, y = batch
        return {"loss": (model(x) - y).pow(2).mean()}


class NoStep:
    def validation_step(self, model, batch):
        return {}


class SomeOfItsOwn:
    monitor, monitor_mode = "val/mae", "min"

    def training_step(self, model, batch):
        err = model(batch["x"]) - batch["y"]
        return {"loss": err.pow(2).mean(), "mae": err.abs().mean()}

    def batch_size(self, batch):
        return 5

    def derived(self, means):
        return {"rmse": means["loss"] ** 0.5}

    def check(self, model, batch):
        raise ConfigError("checked")


def test_a_task_without_the_base_class_gets_each_default():
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    plain = OnlyTrainingStep()
    task = as_task(plain)
    assert isinstance(task, Task) and type(task).__name__ == "OnlyTrainingStep"
    assert torch.equal(task.validation_step(model, (x, y))["loss"], plain.training_step(model, (x, y))["loss"])
    assert task.batch_size((x, y)) == 4
    assert task.derived({"loss": 1.0}) == {}
    assert task.check(model, (x, y)) is None
    assert (task.monitor, task.monitor_mode) == ("val/loss", "min")

    own = as_task(SomeOfItsOwn())
    batch = {"x": x, "y": y}
    assert set(own.validation_step(model, batch)) == {"loss", "mae"}
    assert own.batch_size(batch) == 5 and own.derived({"loss": 4.0}) == {"rmse": 2.0}
    assert (own.monitor, own.monitor_mode) == ("val/mae", "min")
    with pytest.raises(ConfigError, match="checked"):
        own.check(model, batch)

    subclass = Classification()
    assert as_task(subclass) is subclass  # a Task stays what it is
    with pytest.raises(ConfigError, match=r"built a NoStep without a training_step"):
        as_task(NoStep())


@pytest.mark.slow
def test_a_task_without_the_base_class_trains_under_ddp(user_dir: Path):
    env = {"PYTHONPATH": os.pathsep.join([str(user_dir), os.environ.get("PYTHONPATH", "")])}
    run_cli(["--config-dir", str(user_dir / "my_conf"), "task=plain", "trainer.procs=2",
             "trainer.max_epochs=1", "trainer.limit_train_batches=3"], user_dir, timeout=180, env=env)
    (run_dir,) = run_dirs(user_dir / "outputs")
    m = read_metrics(run_dir)
    assert m["status"] == "completed" and m["world_size"] == 2 and m["steps"] == 3
    assert m["monitor"] == "val/loss" and m["final"]["val/loss"] > 0
    assert "test/loss" in m["test"]


TEXT = "".join(f"the {w} sat on the mat. " for w in ("cat", "dog", "bird", "fox") * 60)
LM = ["task=lm", "model=gpt", "data=text", "data.block_size=16", "data.batch_size=16",
      "data.train_stride=4", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
      "model.dropout=0.1", "trainer.procs=2", "trainer.log_every_n_steps=3", "optimizer.lr=0.3"]


@pytest.mark.slow
def test_language_model_learns_and_resumes_bit_exactly_mid_epoch(workdir: Path):
    (workdir / "corpus.txt").write_text(TEXT)
    args = [*LM, f"data.path={workdir / 'corpus.txt'}"]

    def new_run(extra: list[str]) -> Path:
        before = set(run_dirs(workdir / "outputs"))
        run_cli([*args, *extra], workdir, timeout=180)
        (run_dir,) = set(run_dirs(workdir / "outputs")) - before
        return run_dir

    reference = new_run(["trainer.max_epochs=2"])
    m = read_metrics(reference)
    assert m["history"][-1]["val/loss"] < m["history"][0]["val/loss"] < 3.0
    assert m["final"]["val/ppl"] == pytest.approx(float(torch.tensor(m["final"]["val/loss"]).exp()), rel=1e-5)
    steps_per_epoch = m["steps"] // 2
    stopped = new_run(["trainer.max_epochs=2", f"trainer.max_steps={steps_per_epoch + 5}"])
    assert read_metrics(stopped)["steps"] == steps_per_epoch + 5
    run_cli([*args, "trainer.max_epochs=2", "trainer.max_steps=null", f"resume={stopped}"],
            workdir, timeout=180)
    a = torch.load(stopped / "checkpoints/last.pt", weights_only=True)
    b = torch.load(reference / "checkpoints/last.pt", weights_only=True)
    for key in ("model", "optimizer", "epoch", "batch", "step"):
        assert_same_tensors(a[key], b[key], key)
    assert read_metrics(stopped)["final"] == m["final"]
