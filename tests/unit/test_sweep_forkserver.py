"""The fork server a sweep command starts before Hydra runs (sweep/forkserver.py): which
command lines start it, and that one no sweep takes ends at once."""

from __future__ import annotations

import pytest

from ddpexp.sweep import forkserver


@pytest.mark.parametrize("argv", [
    ["-m", "optimizer.lr=0.01,0.1"],
    ["--multirun", "data.batch_size=32,64", "hydra/launcher=ddp"],
    ["-m", "seed=0,1", "hydra.launcher.fork=true", "hydra.launcher.max_parallel=2"],
    ["-m", "seed=0,1", "hydra/sweeper=optuna_async", "--config-dir", "conf"],
])
def test_sweeps_through_the_forking_launcher_start_it_early(argv):
    assert forkserver.forks_early(argv)


@pytest.mark.parametrize("argv", [
    ["optimizer.lr=0.1"],  # one run: no sweep
    ["-m", "seed=0,1", "hydra/launcher=basic"],
    ["-m", "seed=0,1", "hydra/launcher=submitit_slurm"],
    ["-m", "seed=0,1", "hydra.launcher.fork=false"],
    ["-m", "seed=0,1", "hydra.launcher.preload=[mylib]"],  # the server must import them too
    ["-m", "seed=0,1", "+hydra.launcher.preload=[mylib]"],
    ["-m", "seed=0,1", "--config-name", "mine"],  # may pick any launcher
    ["-m", "seed=0,1", "-cn=mine"],
    ["-m", "seed=0,1", "--cfg", "job"],  # prints, runs nothing
    ["-m", "--help"],
])
def test_other_commands_do_not(argv):
    assert not forkserver.forks_early(argv)


@pytest.fixture
def early(monkeypatch):
    """start_early's server for a sweep command line, ended however the test leaves it."""
    monkeypatch.setattr(forkserver, "_EARLY", None)
    forkserver.start_early(["-m", "seed=0,1"])
    server = forkserver._EARLY
    assert server is not None and server.proc is not None and server.proc.poll() is None
    yield server
    server.discard()


def test_a_sweep_of_the_same_imports_takes_the_early_server(early):
    assert forkserver.adopt_early((), torch=True) is early
    assert forkserver._EARLY is None and early.proc.poll() is None
    assert forkserver.adopt_early((), torch=True) is None  # taken once


@pytest.mark.parametrize("preload, torch", [(["mylib"], True), ((), False)])
def test_a_sweep_of_other_imports_ends_it(early, preload, torch):
    assert forkserver.adopt_early(preload, torch=torch) is None
    assert early.proc.poll() is not None  # killed, not left importing torch


def test_a_command_that_took_none_ends_it(early):
    forkserver.discard_early()
    assert forkserver._EARLY is None and early.proc.poll() is not None


def test_a_launcher_that_does_not_fork_ends_it(early):
    """``hydra.launcher.fork=false`` from a config file, which the command line did not show."""
    from omegaconf import OmegaConf

    from ddpexp.sweep import local
    from ddpexp.sweep.backend import HydraSetup
    from ddpexp.sweep.settings import LocalSettings

    hydra = HydraSetup(OmegaConf.create({"trainer": {"procs": 1}}), None, None)  # type: ignore[arg-type]  # the backend reads only the config before a job starts
    sweep = local.LocalBackend(LocalSettings(fork=False), hydra)
    sweep.prepare()
    assert sweep._server is None and forkserver._EARLY is None
    assert early.proc.poll() is not None
