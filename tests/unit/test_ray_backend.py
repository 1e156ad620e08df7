"""The Ray backend's own logic, without a cluster: what a job reserves, where it fits, the
refusal of one no node could hold, the env:// ranks of a job over several nodes, the refusal
of an address where nothing listens, and the launcher's config entry."""

from __future__ import annotations

import socket
import time

import pytest
from omegaconf import OmegaConf

from ddpexp.errors import ConfigError
from ddpexp.launch.world import detect
from ddpexp.sweep.backend import Job
from ddpexp.sweep.ray_cluster import (
    Need,
    Node,
    fits,
    need_of,
    nodes_of,
    probe,
    too_large,
    world_ranks,
)


def _job(procs: int = 1, gpus: int = 0, nodes: int = 1) -> Job:
    job = Job(3, [f"trainer.procs={procs}"], workers=procs, gpus=gpus)
    job.config = OmegaConf.create({"trainer": {"procs": procs, "gpus": gpus, "nodes": nodes}})
    return job


def test_a_job_reserves_a_cpu_per_worker_and_its_gpus_on_each_of_its_nodes() -> None:
    assert need_of(_job(2)) == Need(2, 0, 1)
    assert need_of(_job(1, nodes=2)) == Need(1, 0, 2)
    assert need_of(_job(4, gpus=4)) == Need(4, 4, 1)
    assert Need(2, 1).units() == (1, 1)  # on each node: a CPU with its GPU, a CPU alone
    assert Need(1).units() == (0, 1)
    assert Need(2).describe() == "2 CPUs on one node"
    assert Need(1, 1, 2).describe() == "1 CPU and 1 GPU on each of 2 nodes"


def test_fits_counts_what_the_sweep_holds_on_each_node() -> None:
    head, node = Node("h", "10.0.0.1", 1), Node("n", "10.0.0.2", 2)
    assert fits(Need(2), [head, node]) and fits(Need(1, 0, 2), [head, node])
    node.used_cpus = 1
    assert not fits(Need(2), [head, node])  # one CPU free on each, not two on one
    assert fits(Need(1, 0, 2), [head, node])
    assert fits(Need(2), [head, node], free=False)  # it would fit the empty cluster
    assert not fits(Need(1, 1), [head, node], free=False)  # no GPU anywhere


def test_a_job_no_node_could_hold_is_refused_naming_the_nodes() -> None:
    nodes = [Node("h", "10.0.0.1", 1), Node("n", "10.0.0.2", 2, 1)]
    assert too_large(Need(2), nodes) is None
    why = too_large(Need(3), nodes)
    assert why is not None and why.startswith("it asks for 3 CPUs on one node, more than")
    assert "10.0.0.1 1 CPU, 10.0.0.2 2 CPUs and 1 GPU" in why
    assert too_large(Need(1, 0, 3), nodes) is not None  # three nodes, the cluster has two
    assert too_large(Need(1, 2), nodes) is not None


def test_the_alive_nodes_of_ray_nodes() -> None:
    listing = [{"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1",
                "Resources": {"CPU": 4.0, "GPU": 2.0, "memory": 1e9}},
               {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.2",
                "Resources": {"CPU": 4.0}},
               {"NodeID": "c" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.3",
                "Resources": {"memory": 1e9}}]
    assert [(n.ip, n.cpus, n.gpus) for n in nodes_of(listing)] == [("10.0.0.1", 4, 2),
                                                                 ("10.0.0.3", 0, 0)]


def test_the_ranks_of_a_job_over_several_nodes_are_an_env_world() -> None:
    ranks = world_ranks(Need(2, 0, 2), "10.0.0.1", 29511)
    assert [[r["RANK"] for r in node] for node in ranks] == [["0", "1"], ["2", "3"]]
    third = ranks[1][0]
    world = detect(third)
    assert world is not None and world.launcher == "env"
    assert (world.rank, world.world_size, world.local_rank, world.nodes) == (2, 4, 0, 2)
    assert (world.master_addr, world.master_port) == ("10.0.0.1", 29511)
    assert [[r["NODE_RANK"] for r in node] for node in world_ranks(Need(1, 0, 2), "a", 1)] == \
        [["0"], ["1"]]


def test_an_address_where_nothing_listens_is_refused_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(ConfigError, match=rf"hydra.launcher.address=127.0.0.1:{port}: no Ray "
                                          r"cluster answers there \(.*, for \d+ s\)"):
        probe(f"127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - began < 5
    with pytest.raises(ConfigError, match="is not a Ray address: use auto, HOST:PORT"):
        probe("head-node")
    with socket.socket() as s:  # a listening port answers at once
        s.bind(("127.0.0.1", 0))
        s.listen()
        probe(f"ray://127.0.0.1:{s.getsockname()[1]}", timeout=2)


def test_the_launcher_is_registered_and_imports_no_ray() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "from hydra.core.config_store import ConfigStore\n"
            "from hydra.core.plugins import Plugins\n"
            "from hydra.plugins.launcher import Launcher\n"
            "names = [c.__name__ for c in Plugins.instance().discover(Launcher)]\n"
            "assert 'RayLauncher' in names, names\n"
            "assert 'ray.yaml' in ConfigStore.instance().list('hydra/launcher')\n"
            "assert 'ray' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_config_reference_names_every_ray_launcher_key() -> None:
    from dataclasses import fields
    from pathlib import Path

    from hydra_plugins.ddpexp_launcher.config import RayLauncherConf

    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    keys = [f"hydra.launcher.{f.name}" for f in fields(RayLauncherConf) if f.name != "_target_"]
    assert [k for k in keys if f"`{k}`" not in doc] == []


def test_a_node_that_cannot_write_the_sweep_dir_says_why(tmp_path) -> None:
    from ddpexp.sweep.ray_job import cannot_write

    assert cannot_write(str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []  # its probe file is gone
    why = cannot_write(str(tmp_path / "not-mounted" / "sweep"))
    assert why is not None and why.endswith("the directory does not exist there")


def test_a_job_goes_where_the_sweep_holds_idle_cpus_else_to_the_fullest_node_that_fits() -> None:
    """The choice that lets the next job start in an ended job's CPUs without asking Ray."""
    from ddpexp.sweep.ray_backend import RayBackend
    from ddpexp.sweep.ray_cluster import Unit
    from ddpexp.sweep.settings import RaySettings

    backend = RayBackend(RaySettings(address="auto"), None)  # no job is started: no Hydra set-up
    head, node = Node("h", "10.0.0.1", 1), Node("n", "10.0.0.2", 2)
    backend.nodes = [head, node]
    # Nothing held: a 1-CPU job takes the fuller node, leaving 2 CPUs for a 2-CPU job.
    assert backend._choose(Need(1)) == [head]
    assert backend._choose(Need(2)) == [node]
    # An ended job's CPU idle on the larger node: the next 1-CPU job goes there.
    idle = Unit("n", False, None, idle_since=time.monotonic())
    backend.idle = [idle]
    assert backend._choose(Need(1)) == [node]
    # A 2-CPU job there uses the idle CPU and one new; nothing idle is left over.
    assert backend._take_idle(node, Need(2)) == [idle] and backend.idle == []
    # A node where Ray did not place units in time (it may have just died) is tried last.
    backend._late["h"] = time.monotonic()
    assert backend._choose(Need(1)) == [node]
    node.used_cpus = 2
    assert backend._choose(Need(1)) == [head] and backend._choose(Need(2)) is None
