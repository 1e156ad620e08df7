"""Which launcher started the ranks, read from the environment in-process: the precedence
of torchrun, MPI, SLURM and env://, their rendezvous, the mismatches refused with one
message, and the command that starts the same ranks again. (tests/e2e/test_worlds.py runs the
real launchers.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddpexp.errors import ConfigError
from ddpexp.launch.fanout import world_plan
from ddpexp.launch.ranks import fanout_keys_problem, sweep_problem
from ddpexp.launch.world import PORT_BASE, PORT_SPAN, detect

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29411", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "1"}
OMPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1454833665"}
SRUN = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "cpu1"}
PYTORCHJOB = {"WORLD_SIZE": "3", "RANK": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


def trainer(**kw):
    return SimpleNamespace(**{"strategy": "auto", "gpus": 0, "procs": None, "nodes": 1, **kw})


def test_torchrun_comes_first_also_inside_srun_and_a_pod():
    world = detect({**SRUN, **PYTORCHJOB, **TORCHRUN})
    assert (world.launcher, world.rank, world.local_rank, world.world_size) == ("torchrun", 1, 1, 4)
    assert (world.local_world_size, world.nodes, world.restart) == (2, 2, 1)
    # The agent hosts the store: rank 0 joins it as a client, never binding the agent's port.
    assert world.agent_store and (world.master_addr, world.master_port) == ("node0", 29411)
    assert world.command() == "torchrun --nnodes=2 --nproc-per-node=2 -m ddpexp"


def test_mpirun_inside_an_allocation_is_mpi_not_slurm():
    world = detect({**SRUN, **OMPI})
    assert (world.launcher, world.rank, world.world_size, world.nodes) == ("mpi", 0, 2, 1)
    # One node and no MASTER_ADDR: loopback, a port from the MPI job's id.
    assert world.master_addr == "127.0.0.1" and PORT_BASE <= world.master_port < PORT_BASE + PORT_SPAN
    assert detect({**OMPI, "OMPI_MCA_ess_base_jobid": "99"}).master_port != world.master_port
    assert detect({**OMPI, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "24000"}).master_port == 24000
    assert world.command() == "mpirun -np 2 python -m ddpexp"


def test_mpich_variables_are_mpi_too():
    world = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                    "PMI_KVSNAME": "kvs_77_0"})
    assert (world.launcher, world.rank, world.local_rank, world.world_size) == ("mpi", 1, 1, 2)


def test_several_mpi_nodes_need_a_master_address():
    with pytest.raises(ConfigError, match=r"4 ranks on 2 nodes: set MASTER_ADDR .* and MASTER_PORT"):
        detect({**OMPI, "OMPI_COMM_WORLD_SIZE": "4"})


def test_srun_then_env_vars_then_nobody():
    assert detect(SRUN).launcher == "slurm"
    world = detect(PYTORCHJOB)
    assert (world.launcher, world.rank, world.world_size, world.nodes) == ("env", 2, 3, 3)
    assert (world.master_addr, world.master_port, world.agent_store) == ("job-master-0", 23456, False)
    assert world.command() == "python -m ddpexp"
    assert detect({}) is None
    assert detect({**PYTORCHJOB, "WORLD_SIZE": "1", "RANK": "0"}) is None  # one process: no world
    # A process started by one of ddpexp's own workers is no rank of a launcher's world.
    assert detect({**TORCHRUN, "DDPEXP_WORKER": "1"}) is None


def test_pytorchjob_variable_mistakes_are_one_message():
    with pytest.raises(ConfigError, match=r"PET_NPROC_PER_NODE=2 asks for several processes per "
                                          r"pod, which torchrun starts"):
        detect({**PYTORCHJOB, "PET_NPROC_PER_NODE": "2"})
    with pytest.raises(ConfigError, match=r"MASTER_PORT is not"):
        detect({k: v for k, v in PYTORCHJOB.items() if k != "MASTER_PORT"})
    with pytest.raises(ConfigError, match=r"RANK='two' is not a whole number"):
        detect({**PYTORCHJOB, "RANK": "two"})


def test_a_launchers_layout_disagreeing_with_the_config_is_refused():
    world = detect(TORCHRUN)
    assert world_plan(trainer(), world).world_size == 4
    with pytest.raises(ConfigError, match=r"trainer.procs=4, but torchrun's workers are 2 process\(es\) "
                                          r"per node,.*torchrun --nproc-per-node=4"):
        world_plan(trainer(procs=4), world)
    with pytest.raises(ConfigError, match=r"trainer.gpus=1, but torchrun's workers are 2"):
        world_plan(trainer(gpus=1), world)
    with pytest.raises(ConfigError, match=r"trainer.nodes=3, but torchrun's workers span 2 node"):
        world_plan(trainer(nodes=3), world)
    assert world_plan(trainer(nodes=2), world).nodes == 2


def test_trainer_nodes_under_torchrun_says_torchruns_nnodes_decides_in_one_message():
    """It asked for trainer.rdzv_endpoint, then refused that: now one message, on the command
    line (before Hydra) and from a config (world_plan), and no endpoint asked for."""
    one_node = detect({**TORCHRUN, "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "RANK": "0",
                       "LOCAL_RANK": "0"})
    says = ("trainer.nodes=2, but torchrun's workers span 1 node(s): the launcher decides the "
            "nodes, not trainer.nodes. Leave trainer.nodes unset (and trainer.rdzv_endpoint: both "
            "are for ddpexp's own fan-out), and for 2 nodes start torchrun --nnodes=2 "
            "--rdzv-endpoint=HOST:PORT ... on each of the 2 nodes (torchrun's --nnodes is the "
            "number of nodes)")
    assert fanout_keys_problem(["trainer.nodes=2"], one_node) == says
    assert fanout_keys_problem(["trainer.nodes=2", "trainer.rdzv_endpoint=h:1"], one_node) == says
    with pytest.raises(ConfigError) as refused:
        world_plan(trainer(nodes=2), one_node)
    assert str(refused.value) == says
    assert fanout_keys_problem(["trainer.nodes=1"], one_node) is None
    assert fanout_keys_problem(["trainer.nodes=2"], detect(TORCHRUN)) is None  # it spans 2
    assert "start srun --nodes=3" in fanout_keys_problem(["trainer.nodes=3"], detect(SRUN))
    # The composed config's check asks no rendezvous of a launcher's world.
    from omegaconf import open_dict

    from ddpexp.config.compose import composed
    from ddpexp.config.validate import validate

    cfg = composed(["trainer.nodes=2"])
    with open_dict(cfg):
        cfg.pop("hydra", None)
    validate(cfg, launched_elsewhere=True)
    with pytest.raises(ConfigError, match=r"trainer.nodes=2 needs trainer.rdzv_endpoint=HOST:PORT"):
        validate(cfg)


def test_ddpexps_own_fan_out_keys_and_sweeps_are_refused_in_a_launchers_world():
    world = detect(TORCHRUN)
    assert "torchrun --max-restarts=N" in fanout_keys_problem(["trainer.max_restarts=2"], world)
    assert "leave trainer.rdzv_endpoint unset" in fanout_keys_problem(
        ["trainer.rdzv_endpoint=h:1"], world)
    assert fanout_keys_problem(["trainer.max_restarts=0", "optimizer.lr=0.1"], world) is None
    text = sweep_problem(["-m", "seed=0,1"], world)
    assert "cannot run on torchrun's workers, which are the ranks of one run" in text
    assert "cannot run on the MPI job's ranks" in sweep_problem(["--multirun"], detect(OMPI))


def test_the_launchers_own_command_line_is_kept_up_to_ddpexps_arguments(tmp_path, monkeypatch):
    from ddpexp.launch.world import launcher_prefix

    args = ["model=mlp", "trainer.max_epochs=2"]
    mpirun = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "/usr/bin/python3",
              "-m", "ddpexp", *args]
    assert launcher_prefix(mpirun, ["/usr/bin/python3", "-m", "ddpexp", *args]) == [
        "mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "/usr/bin/python3",
        "-m", "ddpexp"]
    # torchrun's console script run by its venv's python; the worker is `python -u -m ddpexp`.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "torchrun"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    agent = [str(bin_dir / "python3"), str(script), "--nproc-per-node=2", "--master-port=29411",
             "-m", "ddpexp", *args]
    worker = [str(bin_dir / "python3"), "-u", "-m", "ddpexp", *args]
    assert launcher_prefix(agent, worker) == ["torchrun", "--nproc-per-node=2",
                                              "--master-port=29411", "-m", "ddpexp"]
    # A parent that did not hand these arguments on (a shell script, orted) is no launcher.
    assert launcher_prefix(["bash", "run.sh"], worker) is None
    assert launcher_prefix(agent, ["python", "-m", "pytest", *args]) is None
