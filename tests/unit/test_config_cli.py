"""The command line before Hydra reads it (config/cli.py)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from ddpexp.config import cli, commands


def test_unknown_trainer_key_suggests_closest():
    text = cli.unknown_trainer_keys(["trainer.gpu=4", "model=mlp"])
    assert text.startswith("unknown trainer key trainer.gpu: did you mean trainer.gpus?\n(trainer keys: gpus, procs,")


def test_unknown_trainer_key_without_close_match():
    text = cli.unknown_trainer_keys(["+trainer.zzzzqqq=1"])
    assert text.startswith("unknown trainer key trainer.zzzzqqq: it is not a trainer key")


def test_known_and_nested_trainer_keys_pass():
    assert cli.unknown_trainer_keys(["trainer.gpus=1", "trainer.fsdp.wrap=[A]", "trainer.max_epochs"]) is None


def test_a_misspelt_group_or_top_level_key_names_the_override_corrected():
    groups = ("(groups: callbacks, data, debug, experiment, logger, model, optimizer, scheduler, "
              "task, trainer; keys: seed, resume, overwrite)")
    assert cli.preflight(["modle=mlp"]) == f"unknown group or key modle: did you mean model=mlp?\n{groups}"
    assert cli.unknown_top_level(["mdoel.hidden=[3]"]).startswith(
        "unknown key mdoel.hidden: did you mean model.hidden=[3]?")
    assert cli.unknown_top_level(["seeed=3"]).startswith("unknown group or key seeed: did you mean seed=3?")
    assert cli.unknown_top_level(["~modle"]).startswith("unknown group or key modle: did you mean ~model?")
    assert cli.unknown_top_level(["zzzqqq=1"]).startswith(
        "unknown group or key zzzqqq: it is neither a config group nor a key of the config (to "
        "add a key of your own: +zzzqqq=1)")
    # Known names, additions, Hydra's own keys and another primary config pass; a config
    # dir's own groups are groups.
    for fine in (["model=mlp", "experiment=char_gpt", "debug=fast", "seed=1", "overwrite=true",
                  "+mine=1", "hydra.job.chdir=true", "-m", "seed=1,2"], ["-cn", "other", "modle=mlp"],
                 ["--config-dir", str(Path(cli.__file__).parents[1] / "conf" / "debug" / ".."),
                  "debug=fast"]):
        assert cli.unknown_top_level(fine) is None, fine
    # A flag's value is no override; a search path of its own may hold any group.
    assert cli.unknown_top_level(["--cfg", "job", "modle=x"]).startswith(
        "unknown group or key modle: did you mean model=x?")
    assert cli.unknown_top_level(["-p", "trainer", "--cfg", "job"]) is None
    assert cli.unknown_top_level(["hydra.searchpath=[pkg://mine]", "mine=1"]) is None


def test_a_config_dirs_groups_are_groups(tmp_path):
    (tmp_path / "mygroup" / "sub").mkdir(parents=True)
    (tmp_path / "mygroup" / "sub" / "a.yaml").write_text("x: 1\n")
    (tmp_path / "not_a_group").mkdir()  # no YAML in it
    conf = ["--config-dir", str(tmp_path)]
    assert cli.unknown_top_level([*conf, "mygroup/sub=a"]) is None
    text = cli.unknown_top_level([*conf, "mygrop=a"])
    assert text.startswith("unknown group or key mygrop: did you mean mygroup=a?")
    assert "mygroup" in text.splitlines()[1] and "not_a_group" not in text


def test_keys_of_the_built_nodes_name_the_closest_key_or_argument():
    assert cli.preflight(["model.hiden=[64]"]) == (
        "unknown key model.hiden: did you mean model.hidden?\n"
        "(model: input_shape, num_classes, channels, hidden, dropout)")
    assert cli.unknown_group_keys(["model=mlp", "~model.hiden"]).endswith(
        "(model: input_shape, num_classes, hidden, dropout)")
    # An argument of the target that the config does not set: added with +.
    assert cli.unknown_group_keys(["optimizer.dampening=0.1"]) == (
        "optimizer.dampening is not set by the optimizer config, but torch.optim.SGD takes it: "
        "add it with +optimizer.dampening=0.1")
    assert cli.unknown_group_keys(["optimizer.dampenin=0.1"]) == (
        "unknown key optimizer.dampenin: did you mean optimizer.dampening? (torch.optim.SGD "
        "takes it; the config does not set it: +optimizer.dampening=0.1)")
    assert cli.unknown_group_keys(["model=mlp", "model.zzzq=1"]) == (
        "unknown key model.zzzq: ddpexp.models.MLP takes no argument zzzq\n"
        "(ddpexp.models.MLP takes: input_shape, num_classes, hidden, dropout)")
    assert cli.unknown_group_keys(["-m", "scheduler.gamma=0.1,0.2"]).startswith(
        "unknown key scheduler.gamma: the scheduler config sets no _target_ and no keys")
    # A new _target_ is composed first (its arguments are what the key is checked against);
    # keys that are there and additions pass.
    assert cli.unknown_group_keys(["model._target_=collections.Counter", "model.zzzq=1"]) == (
        "model.zzzq is not set by the model config, but collections.Counter takes it: add it "
        "with +model.zzzq=1")
    assert cli.unknown_group_keys(["model=mlp", "model.hidden=[8]", "+model.x=1",
                                   "-m", "optimizer.lr=0.1,0.2"]) is None
    assert cli.unknown_group_keys(["data=imagefolder", "data.root=x"]) is None  # root: ???
    # A key of the option chosen (or the default) needs no composition to pass.
    assert cli._in_an_option("optimizer.lr", {}, None)
    assert cli._in_an_option("model.hidden", {"model": "mlp"}, None)
    assert not cli._in_an_option("scheduler.gamma", {}, None)  # scheduler=none: composed
    assert cli._in_an_option("scheduler.gamma", {"scheduler": "step"}, None)
    assert not cli._in_an_option("model.hidden", {"experiment": "char_gpt"}, None)


def test_a_group_list_with_a_typo_names_the_options_there_are():
    text = cli.preflight(["logger=[tensorboard,mlfow]"])
    assert text == ("logger=[tensorboard,mlfow]: logger has no option 'mlfow'; did you mean "
                    "mlflow? (logger options: csv, mlflow, tensorboard, wandb)")
    assert cli.unknown_group_options(["-m", "logger=[csv,zzz]", "optimizer.lr=1,2"]) == (
        "logger=[csv,zzz]: logger has no option 'zzz' (logger options: csv, mlflow, tensorboard, wandb)")
    # A single option and a sweep's choices too (Hydra lists its search path with them).
    assert cli.preflight(["model=mlpp"]) == ("model=mlpp: model has no option 'mlpp'; did you "
                                             "mean mlp? (model options: convnet, gpt, mlp, resnet18)")
    assert cli.unknown_group_options(["-m", "model=mlp,convnt"]).startswith(
        "model=mlp,convnt: model has no option 'convnt'; did you mean convnet?")
    for fine in (["logger=[tensorboard,mlflow]"], ["logger=csv"], ["model=mlp"], ["logger=[]"],
                 ["-m", "model=mlp,convnet"], ["~scheduler"], ["experiment=null"],
                 ["logger=[mine]", "hydra.searchpath=[file://conf]"]):
        assert cli.unknown_group_options(fine) is None, fine


def test_command_line_values_typed_and_unquoted():
    values = commands.command_line_values([
        "-m", 'hydra.run.dir="outputs/my run"', "trainer.max_epochs=3", "resume=null",
        "+x.y=true", "a=1,2", "~callbacks.ema", "seed=range(3)", "bad=[",
    ])
    assert values == {"hydra.run.dir": "outputs/my run", "trainer.max_epochs": 3, "resume": None,
                      "x.y": True, "a": commands.SWEPT, "seed": commands.SWEPT}


def test_command_line_values_escaped_space():
    assert commands.command_line_values(["hydra.run.dir=outputs/my\\ run"]) == {"hydra.run.dir": "outputs/my run"}


@pytest.mark.parametrize("value, word", [
    ("outputs/run", "resume=outputs/run"),
    ("outputs/my run é", "'resume=\"outputs/my run é\"'"),
    ("null", "'resume=\"null\"'"),
])
def test_command_line_override(value, word):
    assert commands.command_line_override("resume", value) == word


@pytest.mark.parametrize("value", ["a b", " lead", 'say "hi"', "back\\slash\\", "ünï", "1e3", "[x]"])
def test_command_line_override_reads_back(value):
    word = commands.command_line_override("k", value)
    (arg,) = shlex.split(word)
    assert OverridesParser.create().parse_override(arg).value() == value


def test_preflight_typo_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "did you mean trainer.max_epochs" in cli.preflight(["trainer.max_epoch=1"])


def test_preflight_missing_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.preflight([f"resume={tmp_path}/gone"]) == (
        f"resume={tmp_path}/gone is neither auto, a run dir nor a checkpoint file that exists")
    assert cli.preflight(["resume=auto"]) is None
    assert not (tmp_path / "outputs").exists()


def run_dir_with_run(tmp_path):
    run = tmp_path / "old"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    (run / "ddpexp.log").write_text("log")
    (run / "notes.txt").write_text("mine")
    return run


def test_preflight_refuses_run_dir_holding_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith("SUBMITIT_"):
            monkeypatch.delenv(k)
    run = run_dir_with_run(tmp_path)
    text = cli.preflight([f"hydra.run.dir={run}"])
    assert text == (f"hydra.run.dir={run} already holds a run; a new run there would overwrite its "
                    f"checkpoints and metrics.json. Continue it with resume={run}, start it over "
                    "with overwrite=true (removes its outputs first), or pick another hydra.run.dir")
    assert cli.preflight([f"hydra.run.dir={run}", f"resume={run}"]) is None


def test_preflight_overwrite_removes_outputs_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = run_dir_with_run(tmp_path)
    assert cli.preflight([f"hydra.run.dir={run}", "overwrite=true"]) is None
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_preflight_sweep_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "metrics.json").write_text("{}")
    (sweep / "1").mkdir()
    text = cli.preflight(["-m", f"hydra.sweep.dir={sweep}"])
    assert text.startswith(f"hydra.sweep.dir={sweep} already holds 1 run(s) of an earlier sweep")
    assert "Continue it with resume=auto" in text


def test_preflight_multinode_shares_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = run_dir_with_run(tmp_path)
    assert cli.preflight([f"hydra.run.dir={run}", "trainer.nodes=2"]) is None


def test_env_flag(monkeypatch):
    for value, expected in (("1", True), ("yes", True), ("0", False), ("False", False), ("", False)):
        monkeypatch.setenv("DDPEXP_X", value)
        assert cli.env_flag("DDPEXP_X") is expected
    monkeypatch.delenv("DDPEXP_X")
    assert not cli.env_flag("DDPEXP_X")


def test_the_resume_command_keeps_every_flag_and_override_quoted_for_a_shell():
    args = ["hydra.run.dir=outputs/old", "--config-dir", "my conf", "+callbacks.mine._target_=m.C",
            "-cn", "other", "~callbacks.ema", "resume=auto", "model.hidden=[8, 8]", "-cp=conf",
            "+resume=x", "'data.path=a b'"]
    line = commands.resume_command(args, run_dir="outputs/my run", prefix="srun -n 2 python -m ddpexp")
    assert line.startswith("srun -n 2 python -m ddpexp --config-dir 'my conf' -cn other -cp=conf ")
    assert shlex.split(line)[6:] == [
        "--config-dir", "my conf", "-cn", "other", "-cp=conf", "resume=outputs/my run",
        "+callbacks.mine._target_=m.C", "~callbacks.ema", "model.hidden=[8, 8]", "'data.path=a b'"]
    # A flag's value is the flag's, whatever it looks like.
    assert shlex.split(commands.resume_command(["-cn", "resume=x"], run_dir="r"))[3:] == [
        "-cn", "resume=x", "resume=r"]


def test_the_command_that_continues_a_sweep(monkeypatch):
    args = ["-m", "seed=1,2", "hydra.sweep.dir=old", "hydra.run.dir=kept", "resume=auto"]
    line = commands.resume_command(args, sweep_dir="/s w")
    assert shlex.split(line) == ["python", "-m", "ddpexp", "-m", "resume=auto",
                                 "hydra.sweep.dir=/s w", "seed=1,2", "hydra.run.dir=kept"]
    # A job process learns the sweep's command from the sweep's process.
    monkeypatch.setattr("sys.argv", ["job.py", "spec", "result"])
    monkeypatch.delenv(commands.SWEEP_COMMAND_ENV, raising=False)
    assert commands.sweep_command() is None
    assert commands.continue_sweep("/s") == "run the sweep's command again with: resume=auto hydra.sweep.dir=/s"
    monkeypatch.setenv(commands.SWEEP_COMMAND_ENV, '["-m", "seed=1,2"]')
    assert commands.continue_sweep("/s") == "run:\n  python -m ddpexp -m resume=auto hydra.sweep.dir=/s seed=1,2"


def test_entry_typos_name_the_entries_of_the_composed_config(tmp_path):
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "mine.yaml").write_text(
        "defaults:\n  - default\nweight_norms:\n  _target_: m.Norms\n  every: 2\n")
    conf = ["--config-dir", str(tmp_path), "callbacks=mine"]
    text = cli.unknown_group_keys([*conf, "callbacks.weight_norm.every=3"])
    assert text.startswith("unknown entry callbacks.weight_norm: did you mean callbacks.weight_norms?")
    assert "weight_norms" in text.splitlines()[1]
    assert cli.unknown_group_keys([*conf, "callbacks.weight_norms.evry=3"]).startswith(
        "unknown key callbacks.weight_norms.evry: did you mean callbacks.weight_norms.every?")
    # Keys that are there, additions, sweeps of other keys and another primary config pass.
    assert cli.unknown_group_keys([*conf, "callbacks.weight_norms.every=3", "+callbacks.x._target_=a.B",
                                   "~callbacks.ema", "seed=1,2"]) is None
    assert cli.unknown_group_keys(["-cn", "other", "callbacks.nope.x=1"]) is None
    assert cli.unknown_group_keys(["model=mlp"]) is None  # nothing composed
