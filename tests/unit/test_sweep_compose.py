"""A sweep job's config from :class:`ddpexp.sweep.compose.Composer` is the config Hydra's
``load_sweep_config`` composes for the same overrides, node for node, whether it was composed
or copied from the first job of its shape; only jobs that differ in values are copies."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import OmegaConf

from ddpexp.config.schema import register_configs
from ddpexp.sweep.compose import Composer


@pytest.fixture
def sweep(tmp_path: Path):
    """(Hydra's config loader, the sweep's own config) for ddpexp's config, as a multirun has."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module("ddpexp.conf", version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration(
            # Hydra's overrides are lines, unresolved: this one resolves only in a job.
            "config", [f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=j${hydra.job.num}"],
            run_mode=RunMode.MULTIRUN)
        yield loader, master
    GlobalHydra.instance().clear()


def same(composer: Composer, loader, master, overrides: list[str]) -> None:
    """The composer's config for ``overrides`` is Hydra's, flags and all."""
    mine = composer.compose(overrides)
    hydras = loader.load_sweep_config(master, list(overrides))
    assert OmegaConf.to_yaml(mine) == OmegaConf.to_yaml(hydras)
    assert OmegaConf.to_container(mine.hydra.overrides.task) == overrides  # as written
    assert OmegaConf.is_struct(mine) and OmegaConf.is_struct(hydras)
    assert OmegaConf.is_readonly(mine.hydra) == OmegaConf.is_readonly(hydras.hydra)


def test_jobs_that_differ_in_values_are_copies_equal_to_hydras(sweep):
    loader, master = sweep
    composer = Composer(loader, master)
    # An override may hold an interpolation that resolves only later: its line is as written.
    fixed = ["trainer.max_epochs=2", "+callbacks.extra._target_=builtins.dict",
             "trainer.monitor=val/${oc.env:DDPEXP_TEST_UNSET}"]
    for lr, batch in [(0.1, 32), (0.01, 64), (0.003, 32), (1, 128)]:
        same(composer, loader, master, [*fixed, f"optimizer.lr={lr}", f"data.batch_size={batch}"])
    assert composer.composed == 1
    # The override dirname and lines are the job's own.
    cfg = composer.compose([*fixed, "optimizer.lr=0.5", "data.batch_size=16"])
    job = OmegaConf.to_container(cfg.hydra.job)  # unresolved, as Hydra leaves it
    assert isinstance(job, dict) and "optimizer.lr=0.5" in job["override_dirname"]
    assert cfg.optimizer.lr == 0.5 and cfg.data.batch_size == 16


def test_another_config_group_choice_or_added_key_is_composed_by_hydra(sweep):
    loader, master = sweep
    composer = Composer(loader, master)
    for model in ("mlp", "convnet", "mlp"):  # the first tells it that model is a group
        same(composer, loader, master, [f"model={model}", "optimizer.lr=0.1"])
    assert composer.composed == 3
    for model in ("convnet", "mlp"):
        same(composer, loader, master, [f"model={model}", "optimizer.lr=0.2"])
    assert composer.composed == 3
    for value in (1, 2):  # '+key=...' is part of the shape as written
        same(composer, loader, master, [f"+extra={value}"])
    assert composer.composed == 5


def test_the_last_override_of_a_key_wins_in_a_copy_as_in_hydra(sweep):
    loader, master = sweep
    composer = Composer(loader, master)
    same(composer, loader, master, ["optimizer.lr=0.1", "optimizer.lr=0.2"])
    same(composer, loader, master, ["optimizer.lr=0.3", "optimizer.lr=0.2"])
    same(composer, loader, master, ["optimizer.lr=0.2", "optimizer.lr=0.4"])
    assert composer.composed == 1
    assert composer.compose(["optimizer.lr=0.3", "optimizer.lr=0.2"]).optimizer.lr == 0.2


def test_a_bad_value_in_a_copy_fails_with_hydras_error(sweep):
    loader, master = sweep
    composer = Composer(loader, master)
    composer.compose(["trainer.max_epochs=3"])
    with pytest.raises(ConfigCompositionException) as mine:
        composer.compose(["trainer.max_epochs=three"])
    with pytest.raises(ConfigCompositionException) as hydras:
        loader.load_sweep_config(master, ["trainer.max_epochs=three"])
    assert str(mine.value) == str(hydras.value)
    # A key the config lacks fails as Hydra fails it, every time (nothing to copy from).
    for _ in range(2):
        with pytest.raises(ConfigCompositionException, match="Could not override 'nope'"):
            composer.compose(["nope=1"])
