"""What a SLURM task reads from its environment, in-process: the step's port and host, the
plan of a step's ranks, the failure message rank 0 writes. (tests/e2e/test_slurm.py runs the
same paths under a real srun.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from ddpexp.errors import ConfigError
from ddpexp.launch import ranks
from ddpexp.launch.failures import describe_step_failure, resume_hint
from ddpexp.launch.fanout import world_plan
from ddpexp.launch.world import PORT_BASE, PORT_SPAN, detect


def trainer(strategy="auto", gpus=0, procs=None, nodes=1):
    return SimpleNamespace(strategy=strategy, gpus=gpus, procs=procs, nodes=nodes)


@pytest.fixture
def step_env(monkeypatch):
    """A clean SLURM environment of a 2-task step on one node; returns a setter."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    base = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": "gpu[03-05,9],cpu1"}

    def set_env(**values: str) -> None:
        for key, value in {**base, **values}.items():
            monkeypatch.setenv(key, value)

    set_env()
    return set_env


def test_each_step_of_a_job_gets_its_own_port_on_the_first_node(step_env):
    first = detect()
    assert first.launcher == "slurm" and first.master_addr == "gpu03"
    step_env(SLURM_STEP_ID="1")
    second = detect()
    step_env(SLURM_JOB_ID="4243")
    other_job = detect()
    ports = {w.master_port for w in (first, second, other_job)}
    assert len(ports) == 3
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    step_env(MASTER_PORT="23456", MASTER_ADDR="10.0.0.1")  # the user's choice stands
    assert (detect().master_addr, detect().master_port) == ("10.0.0.1", 23456)


def test_a_sweep_inside_an_srun_step_is_refused(step_env):
    world = detect()
    assert "cannot run inside an srun step" in ranks.sweep_problem(["-m", "optimizer.lr=0.1,0.2"], world)
    assert "hydra/launcher=submitit_slurm" in ranks.sweep_problem(["--multirun", "seed=0,1"], world)
    assert ranks.sweep_problem(["optimizer.lr=0.1"], world) is None


def test_a_batch_script_or_one_task_is_no_step_of_ranks(step_env):
    assert detect() is not None
    step_env(SLURM_STEP_ID="4294967294")  # the batch script itself
    assert detect() is None
    step_env(SLURM_NTASKS="1")
    assert detect() is None


@pytest.mark.parametrize("strategy", ["auto", "ddp", "fsdp"])
def test_a_step_spans_its_tasks_with_ddp_or_fsdp(step_env, strategy):
    plan = world_plan(trainer(strategy), detect())
    assert (plan.strategy, plan.procs, plan.nodes) == ("fsdp" if strategy == "fsdp" else "ddp", 2, 1)
    step_env(SLURM_NTASKS="8", SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_STEP_NUM_NODES="2")
    assert world_plan(trainer(strategy, gpus=4), detect()).world_size == 8


def test_workers_that_disagree_with_the_tasks_are_refused(step_env):
    world = detect()
    with pytest.raises(ConfigError, match=r"trainer.strategy=dp cannot span the 2 ranks of the "
                                          r"SLURM step's tasks; use trainer.strategy=ddp or fsdp"):
        world_plan(trainer("dp"), world)
    with pytest.raises(ConfigError, match=r"trainer.procs=4, but the SLURM step's tasks are 2 "
                                          r"process\(es\) per node.*srun --ntasks-per-node=4"):
        world_plan(trainer(procs=4), world)
    with pytest.raises(ConfigError, match=r"trainer.gpus=4, but the SLURM step's tasks are 2 "
                                          r"process\(es\) per node.*or use trainer.gpus=2"):
        world_plan(trainer(gpus=4), world)
    with pytest.raises(ConfigError, match=r"trainer.nodes=3, but the SLURM step's tasks span 1 "
                                          r"node\(s\): the launcher decides the nodes.*srun --nodes=3"):
        world_plan(trainer(nodes=3), world)
    assert world_plan(trainer(procs=2), world).procs == 2


def test_the_resume_hint_repeats_the_srun(step_env, tmp_path, monkeypatch):
    hydra_cfg = SimpleNamespace(mode=None)  # a run, not a sweep
    monkeypatch.setattr("sys.argv", ["ddpexp", "model=mlp", "hydra.run.dir=x"])
    # No checkpoint yet: the hint starts the run again in its dir.
    assert (f"Start it again in {tmp_path} with:\n  srun --ntasks-per-node=2 python -m ddpexp "
            f"resume=auto hydra.run.dir={tmp_path} model=mlp") in resume_hint(tmp_path, hydra_cfg)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    hint = resume_hint(tmp_path, hydra_cfg)
    assert f"  srun --ntasks-per-node=2 python -m ddpexp resume={tmp_path} model=mlp" in hint
    step_env(SLURM_NTASKS="4", SLURM_STEP_NUM_NODES="2")
    assert "srun --nodes=2 --ntasks-per-node=2 python -m ddpexp" in resume_hint(tmp_path, hydra_cfg)


def test_the_failure_message_names_the_cause_not_its_echoes():
    lost = {"pid": 11, "cause": "raised RuntimeError: [gloo] Connection closed by peer"}
    raised = {"pid": 12, "cause": "raised RuntimeError: injected failure on rank 1"}
    text = describe_step_failure({0: lost, 1: raised}, {}, 2, 300, "run/ddpexp.log")
    assert text == ("a worker failed, so the whole SLURM step was stopped:\n"
                    "  rank 1 (pid 12) raised RuntimeError: injected failure on rank 1")
    timed_out = {"pid": 11, "cause": "timed out in a collective", "timeout": True}
    text = describe_step_failure({0: timed_out}, {2: {"pid": 13}}, 3, 20, "run/ddpexp.log")
    assert text.startswith("a worker stalled, so the whole SLURM step was stopped:\n  rank 2 (pid 13) "
                           "stalled: no progress while the others waited trainer.dist_timeout_s=20 s")
    assert "rank 0" not in text and "its Python stack is in run/ddpexp.log" in text
    # Everyone else only lost rank 1, which said nothing: it was killed.
    text = describe_step_failure({0: lost}, {}, 2, 300, "run/ddpexp.log")
    assert "rank 1 died without a Python error (killed by a signal" in text


def test_submitit_slurm_requeues_on_the_pre_timeout_signal_by_default():
    """ddpexp's submitit_slurm: max_num_timeout >= 1 (Hydra's 0 ends the sweep at the first
    pre-timeout signal of a short job), a signal delay that suits short jobs, overridable."""
    from hydra import compose, initialize_config_module
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase

    from ddpexp.config.schema import register_configs

    register_configs()
    try:
        with initialize_config_module(version_base="1.3", config_module="ddpexp.conf"):
            cfg = compose("config", overrides=["hydra/launcher=submitit_slurm"],
                          return_hydra_config=True)
            changed = compose("config", overrides=["hydra/launcher=submitit_slurm",
                                                   "hydra.launcher.max_num_timeout=0"],
                              return_hydra_config=True)
    finally:  # as ddpexp.config.compose.compose_single_process: later launchers expect the default
        Singleton._instances.pop(VersionBase, None)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.max_num_timeout == 3 and launcher.signal_delay_s == 60
    assert changed.hydra.launcher.max_num_timeout == 0


def test_a_rank_that_never_joined_is_the_cause():
    """Rank 0's own wait for the missing rank is no cause of its own: only the missing rank
    is named, with what starts it."""
    waited = {"pid": 11, "cause": "raised DistStoreError: wait timeout after 5000ms"}
    text = describe_step_failure({0: waited}, {}, 3, 5, "run/ddpexp.log", "the whole run",
                                 missing=[2], store="10.0.0.1:29400")
    assert text == (
        "a rank never started, so the whole run was stopped:\n"
        "  rank 2 never joined: the others waited trainer.dist_timeout_s=5 s for it at "
        "10.0.0.1:29400. Start it (RANK=2) with the same MASTER_ADDR, MASTER_PORT and "
        "WORLD_SIZE=3, or give WORLD_SIZE the number of ranks you start")


def test_own_terminal_is_a_pod_or_another_nodes_first_rank():
    from ddpexp.launch.ranks import own_terminal
    from ddpexp.launch.world import World

    def world(launcher, rank, local_rank=0, nodes=2):
        return World(launcher, rank, local_rank, 4, 2, nodes, "10.0.0.1", 29400)

    assert own_terminal(world("env", 1)) and own_terminal(world("env", 3, 1))
    assert not own_terminal(world("env", 0))
    assert own_terminal(world("torchrun", 2)) and not own_terminal(world("torchrun", 3, 1))
    assert not own_terminal(world("torchrun", 1, 1, nodes=1))
    assert not own_terminal(world("slurm", 2)) and not own_terminal(world("mpi", 2))
