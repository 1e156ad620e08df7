"""The typed settings a launcher hands the sweep driver and its backend (ddpexp.sweep.settings)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from ddpexp.errors import ConfigError
from ddpexp.sweep.settings import LocalSettings, RaySettings, SweepSettings
from hydra_plugins.ddpexp_launcher import config as launcher_config
from hydra_plugins.ddpexp_launcher.ddp_launcher import DdpLauncher
from hydra_plugins.ddpexp_launcher.ray_launcher import RayLauncher

MESSAGE = ("hydra.launcher.max_parallel={n} must be >= 1 (K jobs at once, each on its own slice "
           "of the machine), or null (as many at once as the machine holds)")


@pytest.mark.parametrize("settings", [SweepSettings, LocalSettings, RaySettings])
@pytest.mark.parametrize("n", [0, -2])
def test_max_parallel_below_one_is_refused_as_the_settings_are_made(settings, n):
    with pytest.raises(ConfigError) as refused:
        settings(max_parallel=n)
    assert str(refused.value) == MESSAGE.format(n=n)


@pytest.mark.parametrize("n", [None, 1, 3])
def test_max_parallel_of_one_or_more_or_null_is_taken(n):
    assert LocalSettings(max_parallel=n).max_parallel == n


@pytest.mark.parametrize("launcher,conf,settings", [
    (DdpLauncher, launcher_config.DdpLauncherConf, LocalSettings),
    (RayLauncher, launcher_config.RayLauncherConf, RaySettings),
])
def test_each_launcher_takes_exactly_its_keys_and_its_settings_hold_them(launcher, conf, settings):
    """A launcher declares the settings it uses and no other: the ray launcher has no gpus,
    fork or preload; every key users write is a field of its backend's settings."""
    keys = {f.name for f in dataclasses.fields(conf)} - {"_target_"}
    assert set(inspect.signature(launcher.__init__).parameters) - {"self"} == keys
    assert {f.name for f in dataclasses.fields(settings)} == keys
    assert not issubclass(RayLauncher, DdpLauncher)


def test_a_launchers_setup_refuses_a_bad_max_parallel_before_any_sweep_exists():
    launcher = DdpLauncher(max_parallel=0)
    with pytest.raises(SystemExit) as ended:
        launcher.setup(hydra_context=None, task_function=None, config=None)  # type: ignore[arg-type]
    assert str(ended.value) == MESSAGE.format(n=0) and launcher.sweep is None


def test_the_local_backend_is_built_from_its_settings_alone(monkeypatch):
    from ddpexp.sweep import local

    monkeypatch.setattr(local.os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(local.os, "cpu_count", lambda: 4)
    backend = local.LocalBackend(LocalSettings(max_parallel=2, fork=False), None)  # type: ignore[arg-type]
    assert isinstance(backend.slices, local.Slices) and backend.slices.free == 2
    assert isinstance(local.LocalBackend(LocalSettings(), None).slices, local.Packing)  # type: ignore[arg-type]
