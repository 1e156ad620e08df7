"""Composition of every config group with Hydra's real compose API, and the messages that bad
input gets through the real CLI entry point (in this process: no worker is started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import only_run_dir, read_metrics, run_cli_here
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from ddpexp.config.schema import register_configs

register_configs()

CONF = Path(__file__).parents[2] / "src" / "ddpexp" / "conf"
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in
          ("task", "model", "data", "optimizer", "scheduler", "trainer")}
README = Path(__file__).parents[2] / "README.md"
# Options that only make sense together: built as one trainer, which runs the task's
# validation step on real samples before anything trains.
LM = ["task=lm", "model=gpt", "data=text", f"data.path={README}"]
COMPANIONS = {
    ("task", "lm"): LM, ("model", "gpt"): LM, ("data", "text"): LM,
    ("task", "regression"): ["task=regression", "data=diabetes", "model=mlp"],
    ("data", "diabetes"): ["task=regression", "data=diabetes", "model=mlp"],
}


def test_groups_have_the_contract_options():
    assert {"classification", "regression", "lm"} <= set(GROUPS["task"])
    assert {"convnet", "mlp", "resnet18", "gpt"} <= set(GROUPS["model"])
    assert {"digits", "synthetic", "mnist", "fashion_mnist", "cifar10", "imagefolder", "diabetes",
            "text"} <= set(GROUPS["data"])
    assert {"sgd", "adam", "adamw"} <= set(GROUPS["optimizer"])
    assert {"none", "cosine", "step", "onecycle"} <= set(GROUPS["scheduler"])


def _compose(*overrides: str):
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase

    try:
        with initialize_config_module(version_base="1.3", config_module="ddpexp.conf"):
            return compose("config", overrides=list(overrides), return_hydra_config=True)
    finally:
        # initialize_* leaves its version base in a process-wide singleton; Hydra's launcher
        # suites, later in this process, expect the unspecified (pre-1.2) default.
        Singleton._instances.pop(VersionBase, None)


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_builds(group, option, tmp_path):
    if (group, option) == ("data", "hf"):  # a dataset of real rows, written here
        from helpers import build_trainer, write_parquet_rows

        path = write_parquet_rows(tmp_path / "rows.parquet")
        trainer = build_trainer(tmp_path, ["data=hf", f"data.path={path}", "data.input_column=features",
                                           "data.target_column=label", "model=mlp"])
        assert trainer.val_names[0] == "loss"
        return
    if (group, option) == ("data", "shards"):  # tar shards, written here
        from helpers import build_trainer, write_shards

        root = write_shards(tmp_path / "shards", shards=2, per_shard=8)
        trainer = build_trainer(tmp_path, ["data=shards", f"data.path={root}", "model=mlp"])
        assert trainer.val_names[0] == "loss"
        return
    if (group, option) in COMPANIONS:
        from helpers import build_trainer

        trainer = build_trainer(tmp_path, COMPANIONS[group, option])
        assert trainer.val_names[0] == "loss"
        return
    extra = ["data.root=/data/images"] if option == "imagefolder" else []
    cfg = _compose(f"{group}={option}", *extra)
    assert cfg.hydra.launcher._target_.endswith("DdpLauncher")
    with open_dict(cfg):
        del cfg["hydra"]  # resolving it would claim a run dir
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert plain["trainer"]["strategy"] == "auto"
    if plain["data"]["num_classes"] is None:  # imagefolder counts its class folders at run time
        plain["model"]["num_classes"] = 10
    model = instantiate(plain["model"])
    shape = plain["data"]["shape"]
    out = model.eval()(torch.randn(2, *shape))
    assert out.shape == (2, plain["model"]["num_classes"])
    opt = instantiate(plain["optimizer"])(model.parameters())
    if plain.get("scheduler"):
        sched = instantiate(plain["scheduler"])(opt, total_steps=100, steps_per_epoch=10)
        opt.step()
        sched.step()
    data = instantiate(plain["data"], _convert_="all")
    assert data.batch_size == plain["data"]["batch_size"]


def test_model_reads_shapes_by_interpolation():
    cfg = _compose("data=synthetic", "data.shape=[2,9,13]", "data.num_classes=4")
    assert list(cfg.model.input_shape) == [2, 9, 13] and cfg.model.num_classes == 4


@pytest.mark.parametrize("override, message", [
    ("trainer.gpu=4", "unknown trainer key trainer.gpu: did you mean trainer.gpus?"),
    ("trainer.max_epoch=3 trainer.procs=2", "trainer.max_epoch: did you mean trainer.max_epochs?"),
    ("+trainer.foo=1", "trainer.foo: it is not a trainer key"),
    ("trainer.strategy=dpp", "Invalid value 'dpp', expected one of [auto, ddp, fsdp, dp, single]"),
    ("trainer.max_epochs=abc", "trainer.max_epochs=abc: trainer.max_epochs takes an integer, not 'abc'"),
    ("trainer.async_save=maybe",
     "trainer.async_save=maybe: trainer.async_save takes true or false or null, not 'maybe'"),
    ("seed=x", "seed=x: seed takes an integer, not 'x'"),
    ("resume=HERE overwrite=true", "overwrite=true starts a new run in place of the one in the run "
                                   "dir, and resume=HERE continues a run: give one of them"),
    ("trainer.precision=8", "trainer.precision='8' is not one of 32, bf16, 16"),
    ("trainer.precision=16", "needs a GPU; on the CPU use trainer.precision=bf16"),
    ("trainer.procs=0", "trainer.procs=0 must be >= 1"),
    ("trainer.nodes=2", "needs trainer.rdzv_endpoint=HOST:PORT"),
    ("trainer.monitor=val/f1", "trainer.monitor=val/f1 is not a metric of the task (Classification); it returns val/loss, val/acc"),
    ("-m hydra/launcher=rayy seed=0,1", "hydra/launcher=rayy: hydra/launcher has no option 'rayy'; "
                                         "did you mean ray? (hydra/launcher options: basic, ddp, ray"),
    ("model=nonexistent", "model=nonexistent: model has no option 'nonexistent' (model options: convnet,"),
    ("data=imagefolder", "these keys need a value: data.root"),
    ("data=mnist data.root=NODATA", "Put train-images-idx3-ubyte"),
    ("data=cifar10 data.root=NODATA", "test_batch not found in"),
    ("data=imagefolder data.root=NODATA", "does not exist. Lay the images out"),
    ("resume=NOWHERE", "is neither auto, a run dir nor a checkpoint file that exists"),
    ("data.batch_size=0", "data.batch_size=0 must be >= 1"),
    ("trainer.strategy=single trainer.procs=2", "trainer.strategy=single runs one process"),
    ("trainer.strategy=dp trainer.procs=2", "trainer.strategy=dp is one process"),
])
def test_bad_input_gets_one_clear_message(tmp_path, monkeypatch, capsys, override, message):
    def placed(text: str) -> str:
        return (text.replace("NODATA", str(tmp_path / "nodata"))
                .replace("NOWHERE", str(tmp_path / "x")).replace("HERE", str(tmp_path)))

    code, text = run_cli_here(placed(override).split(), tmp_path, monkeypatch, capsys)
    assert code != 0
    assert placed(message) in text
    assert "Traceback" not in text
    if " takes " in message:  # one line, not Hydra's dump of the merge
        assert "full_key" not in text and "HYDRA_FULL_ERROR" not in text
    if override.startswith(("trainer.gpu=", "resume=")):
        assert not (tmp_path / "outputs").exists()  # refused before a run dir was made


def test_a_failed_run_keeps_what_was_written(tmp_path, monkeypatch, capsys):
    """A resume that cannot work must not touch the run it points at."""
    code, text = run_cli_here(["model=mlp", "trainer.max_epochs=1"], tmp_path, monkeypatch, capsys)
    assert code == 0, text
    run_dir = only_run_dir(tmp_path)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code, text = run_cli_here([f"resume={run_dir}", "model=convnet"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Traceback" not in text
    # Refused as a resume may not change the model, naming the key and what it holds.
    assert f"resume={run_dir} cannot change what" in text
    assert "model._target_=ddpexp.models.MLP" in text
    for path, content in before.items():
        if path.name not in ("metrics.json", "ddpexp.log"):
            assert path.read_bytes() == content, path
    # The failed resume leaves no trace of itself in the run's configs either.
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == [
        "config.yaml", "hydra.yaml", "overrides.yaml"]
    assert read_metrics(run_dir)["final"]["val/acc"] > 0
