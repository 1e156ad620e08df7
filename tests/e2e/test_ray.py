"""Sweeps on a real Ray cluster (``hydra/launcher=ray``): a head and a second node as two
raylets of this machine (``ray.cluster_utils.Cluster``), shared by the tests of this module,
every sweep a ``python -m ddpexp -m`` that connects to it by its address."""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from helpers import finish, journal_study, read_metrics, run_cli, start_cli, summary_by_job
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TINY = ["data=synthetic", "data.num_samples=64", "data.val_samples=32", "data.shape=[1,8,8]",
        "data.batch_size=16", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
        "trainer.test=false"]
# Each raylet's object store: the least Ray accepts is 75 MiB.
STORE = 80 * 1024 * 1024
HEAD_CPUS, NODE_CPUS = 1, 2
# A dead raylet is noticed after about 3 missed checks of 1 s.
FAST_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
              "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[HYDRA\] \t"
START = re.compile(STAMP + r"#(\d+) : .*\[Ray: (\d+) CPUs? on (.*?)(?:, attempt \d+)?\]$", re.M)
END = re.compile(STAMP + r"#(\d+) ended \((.*?)\) after", re.M)
NODE = re.compile(r"\(node ([0-9a-f]{8})\)")


@dataclass
class RayCluster:
    cluster: Cluster
    head: str  # node ids' first 8 hex digits, as the launcher's log names them
    worker: str

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def sizes(self) -> dict[str, int]:
        return {self.head: HEAD_CPUS, self.worker: NODE_CPUS}

    def add_worker(self) -> None:
        node = self.cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=STORE)
        self.cluster.wait_for_nodes()
        self.worker = node.node_id[:8]

    def kill_worker(self) -> None:
        node = next(n for n in self.cluster.worker_nodes if n.node_id.startswith(self.worker))
        self.cluster.remove_node(node, allow_graceful=False)


def _cluster_pids(address: str) -> list[int]:
    """Processes whose command line names the cluster's address (GCS, raylets, workers), and
    what the launcher's node agents started: their fork servers and the job processes forked
    from them (``ddpexp.sweep.ray_job`` among the modules it preloads), and job processes
    started afresh (their spec in a ``ddpexp-ray-job-`` dir)."""
    port = address.rsplit(":", 1)[1]
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if ((f":{port}" in cmd or "ddpexp-ray-job-" in cmd or "ddpexp.sweep.ray_job" in cmd)
                    and "pytest" not in cmd):
                pids.append(int(entry.name))
    return pids


def _start_cluster():
    """The cluster and its second node. Ray gives each raylet a fixed 30 s to register, which
    a loaded machine can miss: one more try."""
    for attempt in (1, 2):
        c = Cluster()
        try:
            c.add_node(num_cpus=HEAD_CPUS, object_store_memory=STORE, include_dashboard=False,
                       _system_config=FAST_DEATH)
            node = c.add_node(num_cpus=NODE_CPUS, object_store_memory=STORE)
            c.wait_for_nodes()
            return c, node
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster():
    """A head of 1 CPU and a node of 2 CPUs, as two raylets; nothing of it is left after."""
    c, node = _start_cluster()
    address = str(c.address)
    try:
        assert c.head_node is not None
        yield RayCluster(c, c.head_node.node_id[:8], node.node_id[:8])
    finally:
        c.shutdown()
    deadline = time.time() + 20
    while _cluster_pids(address) and time.time() < deadline:
        time.sleep(0.5)
    assert not _cluster_pids(address), "processes of the Ray cluster left behind"


def ray_sweep(cluster: RayCluster, workdir: Path, *overrides: str, expect_ok: bool = True,
              timeout: float = 400):
    sweep_dir = workdir / "sweep"
    res = run_cli(["-m", "hydra/launcher=ray", f"hydra.launcher.address={cluster.address}",
                   *TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"], workdir,
                  timeout=timeout, expect_ok=expect_ok)
    return res, sweep_dir


def _time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def timeline(output: str) -> dict[int, dict]:
    """Each job's start and end as the launcher logged them, its CPUs and node(s)."""
    jobs: dict[int, dict] = {}
    for m in START.finditer(output):
        jobs[int(m.group(2))] = {"start": _time(m.group(1)), "cpus": int(m.group(3)),
                                 "nodes": NODE.findall(m.group(4))}
    for m in END.finditer(output):
        jobs.setdefault(int(m.group(2)), {})["end"] = _time(m.group(1))
        jobs[int(m.group(2))]["outcome"] = m.group(3)
    return jobs


@pytest.mark.timeout(600)
def test_a_sweep_of_one_and_two_worker_jobs_fills_the_cluster(cluster: RayCluster,
                                                              workdir: Path) -> None:
    res, sweep_dir = ray_sweep(cluster, workdir, "trainer.procs=1,2", "optimizer.lr=0.05,0.1")
    rows = summary_by_job(sweep_dir)
    assert sorted(rows) == ["0", "1", "2", "3"]
    for job, row in rows.items():
        run_dir = sweep_dir / job
        metrics = read_metrics(run_dir)
        assert row["status"] == metrics["status"] == "completed"
        assert metrics["world_size"] == int(dict(o.split("=") for o in row["overrides"].split())
                                             ["trainer.procs"])
        assert (run_dir / "checkpoints" / "best.pt").is_file()
        # TensorBoard's HParams of the job: its overrides.
        acc = EventAccumulator(str(run_dir / "tb"))
        acc.Reload()
        content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        assert start.hparams["optimizer.lr"].number_value == float(
            dict(o.split("=") for o in row["overrides"].split())["optimizer.lr"])
    assert not (workdir / "outputs").exists()

    assert "could not check that every Ray node writes" not in res.output
    jobs = timeline(res.output)
    assert sorted(jobs) == [0, 1, 2, 3] and all(j["outcome"] == "completed" for j in jobs.values())
    sizes = cluster.sizes()
    # No node ever held more of this sweep's workers than it has CPUs.
    for t in sorted({j["start"] for j in jobs.values()}):
        held: dict[str, int] = {}
        for j in jobs.values():
            if j["start"] <= t < j["end"]:
                for node in j["nodes"]:
                    held[node] = held.get(node, 0) + j["cpus"]
        assert all(held[n] <= sizes[n] for n in held), (t, held, jobs)
    # Two-worker jobs only fit the 2-CPU node.
    assert all(j["nodes"] == [cluster.worker] for j in jobs.values() if j["cpus"] == 2)
    # A job that waited for room started within a second of the job whose end made it.
    first = min(j["start"] for j in jobs.values())
    for j in jobs.values():
        if j["start"] - first > 1.0:
            before = [o["end"] for o in jobs.values() if o["end"] <= j["start"] + 0.001]
            assert before and j["start"] - max(before) < 1.0, (j, jobs)


def test_a_raising_job_fails_its_row_and_a_too_large_one_is_refused(cluster: RayCluster,
                                                                   workdir: Path) -> None:
    res, sweep_dir = ray_sweep(cluster, workdir, "trainer.procs=1,3",
                               "optimizer.momentum=0.9,-1", expect_ok=False)
    assert res.returncode != 0
    rows = summary_by_job(sweep_dir)
    assert [rows[j]["status"] for j in "0123"] == ["completed", "failed", "failed", "failed"]
    assert "Invalid momentum value" in rows["1"]["error"]
    for job in "23":  # trainer.procs=3: more than any node has, never placed
        assert "asks for 3 CPUs on one node" in rows[job]["error"]
        assert f"{HEAD_CPUS} CPU" in rows[job]["error"] and f"{NODE_CPUS} CPUs" in rows[job]["error"]
        assert not (sweep_dir / job).exists()
    assert re.search(r"#2 : .*trainer.procs=3 optimizer.momentum=0.9: refused before it was "
                     r"queued: it asks for 3 CPUs on one node", res.output), res.output
    assert "Traceback" not in res.stderr


def test_an_unreachable_address_is_refused_naming_it(workdir: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.time()
    res = run_cli(["-m", "hydra/launcher=ray", f"hydra.launcher.address=127.0.0.1:{port}",
                   *TINY, "seed=0,1", "hydra.sweep.dir=sweep"], workdir, timeout=120,
                  expect_ok=False)
    assert time.time() - began < 45  # within the bound of 30 s, and the command's start-up
    assert res.returncode != 0
    assert f"hydra.launcher.address=127.0.0.1:{port}: no Ray cluster answers there" in res.stderr
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR" not in res.stderr
    assert not (workdir / "sweep").exists()  # refused before the sweep wrote anything


def test_a_job_across_two_nodes_writes_one_run_dir(cluster: RayCluster, workdir: Path) -> None:
    res, sweep_dir = ray_sweep(cluster, workdir, "trainer.nodes=2", "seed=0")
    jobs = timeline(res.output)
    assert sorted(jobs[0]["nodes"]) == sorted([cluster.head, cluster.worker])
    metrics = read_metrics(sweep_dir / "0")
    assert metrics["status"] == "completed" and metrics["world_size"] == 2
    assert [p.name for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()] == ["0"]
    log = (sweep_dir / "0" / "ddpexp.log").read_text()
    assert "2 worker(s) (env:// ranks)" in log
    assert len(list((sweep_dir / "0" / "tb").glob("events.out.tfevents.*"))) == 1


def test_a_sweep_dir_a_node_cannot_write_is_refused_naming_the_node(cluster: RayCluster,
                                                                   tmp_path: Path) -> None:
    """The check every sweep makes before its first job, asked of each node for a dir that
    none of them has (a sweep dir on this machine's disk, not on the nodes' shared storage)."""
    from ddpexp.errors import ConfigError
    from ddpexp.sweep.ray_backend import RayBackend
    from ddpexp.sweep.settings import RaySettings

    backend = RayBackend(RaySettings(address=cluster.address), None)  # no job is started: no Hydra set-up
    with backend:
        backend._check_storage(str(tmp_path))  # every node writes it: no refusal
        with pytest.raises(ConfigError) as refused:
            backend._check_storage(str(tmp_path / "not-shared"))
    message = str(refused.value)
    assert message.startswith(f"hydra.sweep.dir={tmp_path / 'not-shared'}: not every node of "
                              "the Ray cluster can write it")
    for node in (cluster.head, cluster.worker):
        assert f"(node {node}): No such file or directory: the directory does not exist there" \
            in message
    assert not ray.is_initialized()


@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_jobs_and_resume_auto_finishes_the_sweep(cluster: RayCluster,
                                                                  workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    args = ["-m", "hydra/launcher=ray", f"hydra.launcher.address={cluster.address}", *TINY,
            "data.num_samples=256", "trainer.max_epochs=100", "trainer.max_steps=2,150",
            "hydra.launcher.max_parallel=1", f"hydra.sweep.dir={sweep_dir}"]
    proc = start_cli(args, workdir)
    deadline = time.time() + 180
    while not (sweep_dir / "1" / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "job 1 never saved a checkpoint"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the sweep stops its jobs with SIGTERM
    res = finish(proc, timeout=120)
    assert not res.leftovers
    # 128 + SIGINT, the user's signal named, and no Hydra trailer after ddpexp's message.
    assert res.returncode == 130 and "resume=auto" in res.output, res.output
    assert "the sweep was stopped by SIGINT" in res.output
    assert "HYDRA_FULL_ERROR" not in res.output
    assert "#1 ended (interrupted by SIGTERM)" in res.output
    assert read_metrics(sweep_dir / "1")["status"] == "interrupted"
    rows = summary_by_job(sweep_dir)
    assert [rows[j]["status"] for j in "01"] == ["completed", "interrupted"]
    before = {p: p.stat().st_mtime_ns for p in (sweep_dir / "0").rglob("*") if p.is_file()}

    res = run_cli([*args, "resume=auto"], workdir, timeout=240)
    assert "completed before, not run again" in res.output
    assert {p: p.stat().st_mtime_ns for p in (sweep_dir / "0").rglob("*") if p.is_file()} == before
    metrics = read_metrics(sweep_dir / "1")
    assert metrics["status"] == "completed" and metrics["steps"] == 150
    assert "resumed from" in (sweep_dir / "1" / "ddpexp.log").read_text()
    assert [r["status"] for r in summary_by_job(sweep_dir).values()] == ["completed"] * 2


@pytest.mark.timeout(900)
def test_an_async_search_on_ray_prunes_and_resumes_to_more_trials(cluster: RayCluster,
                                                                  workdir: Path) -> None:
    from optuna.trial import TrialState

    sweep_dir = workdir / "sweep"

    # Two good trials first, then one that cannot learn (lr=0), asked once a slot frees,
    # when a good one has completed: the median pruner stops it after its first epoch.
    for lr, epochs in ((0.1, 2), (0.1, 2), (0.0, 3)):
        journal_study(sweep_dir).enqueue_trial({"optimizer.lr": lr, "trainer.max_epochs": epochs})
    args = ["-m", "hydra/launcher=ray", f"hydra.launcher.address={cluster.address}",
            "hydra/sweeper=optuna_async", *TINY, "trainer.max_steps=null",
            "data.num_samples=128", "resume=auto", f"hydra.sweep.dir={sweep_dir}",
            "hydra.launcher.max_parallel=2", "hydra.sweeper.sampler.name=random",
            "hydra.sweeper.sampler.seed=0", "hydra.sweeper.pruner.name=median",
            "hydra.sweeper.pruner.n_startup_trials=1",
            "optimizer.lr=choice(0.1,0.05,0.0)", "trainer.max_epochs=range(1,3)"]
    run_cli([*args, "hydra.sweeper.n_trials=8"], workdir, timeout=600)
    trials = journal_study(sweep_dir).trials
    assert len(trials) == 8 and all(t.state.is_finished() for t in trials)
    assert trials[2].state == TrialState.PRUNED
    assert read_metrics(sweep_dir / "2")["status"] == "pruned"
    assert trials[0].state == trials[1].state == TrialState.COMPLETE
    before = {p: p.stat().st_mtime_ns for p in sweep_dir.glob("[0-7]/**/*") if p.is_file()}

    res = run_cli([*args, "hydra.sweeper.n_trials=10"], workdir, timeout=300)
    assert "8 trial(s) done before, 0 to resume, 2 to ask" in res.output
    trials = journal_study(sweep_dir).trials
    assert len(trials) == 10 and all(t.state.is_finished() for t in trials)
    # None of the first eight ran again.
    assert {p: p.stat().st_mtime_ns for p in sweep_dir.glob("[0-7]/**/*") if p.is_file()} == before
    assert len(summary_by_job(sweep_dir)) == 10


@pytest.mark.timeout(600)
def test_a_killed_node_fails_its_job_and_the_others_complete(cluster: RayCluster,
                                                             workdir: Path) -> None:
    """Near the end of the module: its cluster's second node is replaced by a new one."""
    sweep_dir = workdir / "sweep"
    # Both jobs have 2 workers, which only the 2-CPU node holds: job 0 runs there until the
    # node is killed, job 1 waits for room and gets it on the node that replaces it.
    proc = start_cli(["-m", "hydra/launcher=ray", f"hydra.launcher.address={cluster.address}",
                      *TINY, "data.num_samples=256", "trainer.max_epochs=1000",
                      "trainer.procs=2", "trainer.max_steps=100000,2",
                      f"hydra.sweep.dir={sweep_dir}"], workdir)
    deadline = time.time() + 120
    while not (sweep_dir / "0" / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "job 0 never saved a checkpoint"
        time.sleep(0.2)
    cluster.kill_worker()
    killed = time.time()
    cluster.add_worker()
    res = finish(proc, timeout=180)
    assert not res.leftovers
    assert res.returncode != 0
    jobs = timeline(res.output)
    assert jobs[0]["outcome"] == "failed" and jobs[0]["end"] - killed < 30
    assert jobs[1]["nodes"] == [cluster.worker] and jobs[1]["outcome"] == "completed"
    rows = summary_by_job(sweep_dir)
    assert rows["0"]["status"] == "failed" and "died" in rows["0"]["error"]
    assert rows["1"]["status"] == "completed"


@pytest.mark.timeout(600)
def test_with_retries_a_job_whose_node_died_continues_from_its_checkpoint(
        cluster: RayCluster, workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    proc = start_cli(["-m", "hydra/launcher=ray", f"hydra.launcher.address={cluster.address}",
                      *TINY, "data.num_samples=256", "trainer.max_steps=null",
                      "trainer.max_epochs=6", "trainer.procs=2", "hydra.launcher.retries=1",
                      "seed=0", f"hydra.sweep.dir={sweep_dir}"], workdir)
    deadline = time.time() + 120
    while not (sweep_dir / "0" / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "job 0 never saved a checkpoint"
        time.sleep(0.2)
    cluster.kill_worker()
    cluster.add_worker()
    res = finish(proc, timeout=300)
    assert not res.leftovers
    assert res.returncode == 0, res.output
    assert "placing it again (hydra.launcher.retries=1, retry 1)" in res.output
    assert re.search(r"#0 : .*\[Ray: 2 CPUs on .*, attempt 2\]", res.output), res.output
    metrics = read_metrics(sweep_dir / "0")
    assert metrics["status"] == "completed" and metrics["epochs"] == 6
    assert "resumed from" in (sweep_dir / "0" / "ddpexp.log").read_text()
