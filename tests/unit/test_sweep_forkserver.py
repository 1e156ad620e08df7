"""The fork server a sweep command starts before Hydra runs (sweep/forkserver.py): which
command lines start it, and that one no sweep takes ends at once."""

from __future__ import annotations

import os

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


@pytest.fixture
def serving(tmp_path, monkeypatch):
    """A light fork server (Hydra only) that preloads module ``name`` of ``source`` (written
    to tmp_path) and forks one child running its ``main``: (server, job)."""
    servers = []

    def start(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
        server = forkserver.ForkServer([name], torch=False)
        servers.append(server)
        server.start()
        server.wait_ready(timeout=60)
        assert server.broken is None
        told = server.exits_told
        job = server.spawn(tmp_path / "spec", tmp_path / "result", dict(os.environ),
                           call=f"{name}:main")
        assert job is not None and server.proc is not None
        return server, job, told

    yield start
    for server in servers:
        server.close()


def test_a_child_s_exit_wakes_the_launcher_that_waits_for_it(serving):
    """The launcher frees a slot on the exit the server tells, not at its next poll."""
    server, job, told = serving("ends_with_3", "def main():\n    return 3\n")
    server.wait_exit(told, timeout=60)
    assert server.exits_told == told + 1 and job.poll() == 3


def test_a_forked_job_keeps_the_servers_plugins_unless_its_path_adds_to_it():
    """restore_hydra: the launcher's Singleton state, the plugins discovered once (in the
    server) where the job's import path is the server's, discovered again where it is not."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra.core.singleton import Singleton

    from ddpexp.sweep.job import restore_hydra

    saved = Singleton.get_state()
    scanned = Plugins.instance()
    store = ConfigStore.instance()
    store.store(name="only_in_the_launcher", node={"a": 1})
    state = Singleton.get_state()
    try:
        restore_hydra(state, rescan=False)
        assert Plugins.instance() is scanned
        assert "only_in_the_launcher.yaml" in ConfigStore.instance().list("")
        restore_hydra(state, rescan=True)
        assert Plugins.instance() is not scanned
        assert "only_in_the_launcher.yaml" in ConfigStore.instance().list("")
    finally:
        Singleton.set_state(saved)


def test_a_launcher_waiting_on_a_dead_server_polls_its_orphans_and_does_not_spin(serving):
    """With the server gone no exit is told: each wait lasts its timeout, and the orphaned
    job's end is found by its pid."""
    import signal

    server, job, _ = serving("naps", "import time\n\ndef main():\n    time.sleep(1)\n    return 0\n")
    try:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        waits = 0
        while job.poll() is None and waits < 600:  # at most a minute of 0.1 s waits
            server.wait_exit(server.exits_told, 0.1)
            waits += 1
        assert job.poll() == -signal.SIGKILL  # ended unreported: said as killed
        assert 3 <= waits < 600  # the second it slept, in waits of 0.1 s, not a spin
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_a_forked_child_finds_the_plugins_the_server_discovered(serving):
    """The server discovers Hydra's plugins before it forks: its children start with them
    (exit 0), where each would otherwise discover them again (exit 1)."""
    server, job, told = serving("has_plugins", (
        "def main():\n"
        "    from hydra.core.plugins import Plugins\n"
        "    from hydra.core.singleton import Singleton\n"
        "    return 0 if Plugins in Singleton._instances else 1\n"))
    server.wait_exit(told, timeout=60)
    assert job.poll() == 0
