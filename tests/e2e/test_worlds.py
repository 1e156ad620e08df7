"""Ranks that another launcher started form one run: torchrun (one node, two agents as two
nodes with static and c10d rendezvous, restarts), the env:// variables of a Kubernetes
PyTorchJob, and OpenMPI's mpirun. Real launchers, real gloo groups, free ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import finish, only_run_dir, read_metrics, run_dirs, run_printed

PLUGINS = str(Path(__file__).parents[1] / "plugins")
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
        "data.val_samples=101", "model=mlp", "model.hidden=[16]", "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1", "data.batch_size=32"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

pytestmark = pytest.mark.slow


def free_port() -> int:
    from ddpexp.runtime.dist import free_port as pick

    return pick()


def start(cmd: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """``cmd`` in a session of its own (so that everything it starts can be found), with the
    test plugins importable and none of the launchers' variables of this process."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "PET_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                          "HYDRA_FULL_ERROR")}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [PLUGINS, full.get("PYTHONPATH")]))
    full.update(PYTHONUNBUFFERED="1", **env)
    return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def one_run(workdir: Path, world: int) -> dict:
    """The one run dir under ``workdir``, completed by ``world`` workers."""
    dirs = run_dirs(workdir / "outputs")
    assert len(dirs) == 1, dirs
    metrics = read_metrics(dirs[0])
    assert metrics["status"] == "completed" and metrics["world_size"] == world, metrics
    log = (dirs[0] / "ddpexp.log").read_text()
    assert log.count("run dir: ") == 1
    return metrics


def test_torchrun_on_one_node_is_one_run(workdir):
    res = finish(start([*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        f"--master-port={free_port()}", "-m", "ddpexp", *TINY], workdir), 240)
    assert res.returncode == 0, res.output
    assert not res.leftovers
    assert "2 worker(s) (torchrun workers): strategy=ddp" in res.output
    one_run(workdir, 2)


FIND = ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.shape=[1,4,4]",
        "data.num_classes=3", "data.num_samples=256", "data.val_samples=32", "~logger",
        "data.batch_size=16", "find.steps=20", "find.lr_min=1e-3", "find.lr_max=3"]


def test_find_lr_under_torchrun_is_one_search_with_the_curve_of_its_world(workdir):
    """torchrun's two ranks make one search in one run dir, with the curve that
    ``trainer.procs=2`` gives (the same global loss at every point)."""
    res = finish(start([*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        f"--master-port={free_port()}", "-m", "ddpexp.find", "lr", *FIND,
                        "hydra.run.dir=outputs/torchrun"], workdir), 240)
    assert res.returncode == 0, res.output
    assert not res.leftovers
    assert "2 worker(s); " in res.output
    assert sorted(p.name for p in (workdir / "outputs").iterdir()) == ["torchrun"]
    local = finish(start([sys.executable, "-m", "ddpexp.find", "lr", *FIND, "trainer.procs=2",
                          "hydra.run.dir=outputs/procs"], workdir), 240)
    assert local.returncode == 0, local.output
    under, own = (json.loads((workdir / "outputs" / d / "find/lr.json").read_text())
                  for d in ("torchrun", "procs"))
    assert under["lr"] == own["lr"] and under["suggested_lr"] == own["suggested_lr"]
    assert under["loss"] == pytest.approx(own["loss"], rel=1e-6)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_torchrun_agents_as_two_nodes_are_one_run(workdir, rendezvous):
    port = free_port()
    if rendezvous == "static":
        flags = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    else:
        flags = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                 f"--rdzv-id={uuid.uuid4().hex[:8]}"]
    agents = [start([*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}", *flags,
                     "-m", "ddpexp", *TINY], workdir) for n in range(2)]
    results = [finish(a, 300) for a in agents]
    for res in results:
        assert res.returncode == 0, res.output
        assert not res.leftovers
    one_run(workdir, 2)


def test_a_raising_rank_under_two_torchrun_agents_is_one_message(workdir):
    """Rank 1 raises under two agents with a c10d rendezvous, and its agent hosts the
    rendezvous store: it is started first (it binds the port), with the address that sorts
    last (the rendezvous ranks agents by address). Rank 0's agent keeps its terminal free of
    the TCPStore stack of a store gone under it: ddpexp's one message, then torchrun's own
    report; the raising rank's terminal says where the run's log is and its own error."""
    port, rdzv = free_port(), uuid.uuid4().hex[:8]
    flags = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv}"]
    run = ["-m", "ddpexp", *TINY, "model._target_=faulty.Faulty", "+model.mode=raise"]
    host = start([*TORCHRUN, *flags, "--local-addr=127.0.0.2", *run], workdir)
    time.sleep(3)
    other = start([*TORCHRUN, *flags, "--local-addr=127.0.0.1", *run], workdir)
    rank0, rank1 = finish(other, 300), finish(host, 300)
    assert rank0.returncode != 0 and rank1.returncode != 0
    assert not rank0.leftovers and not rank1.leftovers
    assert rank0.stderr.startswith("a worker failed, so the whole run was stopped:\n  rank 1 "
                                   "(pid "), rank0.output
    assert "raised RuntimeError: injected failure on rank 1\n" in rank0.stderr.split("\n")[1] + "\n"
    for res in (rank0, rank1):
        assert "TCPStore" not in res.stderr and "RendezvousConnectionError" not in res.stderr, \
            res.stderr
    assert "rank 1 of 2 (torchrun workers): rank 0, on " in rank1.stderr
    assert "rank 1 raised RuntimeError: injected failure on rank 1; the run's message is " \
           "rank 0's" in rank1.stderr
    metrics = read_metrics(only_run_dir(workdir))
    assert metrics["status"] == "failed" and "injected failure on rank 1" in metrics["error"]


def test_pytorchjob_variables_are_one_run(workdir):
    port = str(free_port())
    ranks = [start([sys.executable, "-m", "ddpexp", *TINY], workdir, WORLD_SIZE="2",
                   RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
    results = [finish(p, 240) for p in ranks]
    assert all(r.returncode == 0 for r in results), [r.output for r in results]
    assert "2 worker(s) (env:// ranks)" in results[0].output
    one_run(workdir, 2)
    # A worker pod's own log says where the run's log is, once, and nothing else.
    log_file = run_dirs(workdir / "outputs")[0] / "ddpexp.log"
    assert results[1].output == (
        "rank 1 of 2 (env:// ranks): rank 0, on 127.0.0.1, writes the run dir and its log "
        f"{log_file}; this rank's warnings and errors go to that log too, and show here\n")


def test_a_rank_that_never_starts_is_named_within_the_timeout(workdir):
    """WORLD_SIZE=2 but only rank 0 is started: the run stops trainer.dist_timeout_s after
    it began waiting, names the missing rank, and leaves no run dir."""
    started = time.time()
    res = finish(start([sys.executable, "-m", "ddpexp", *TINY, "trainer.dist_timeout_s=5"],
                       workdir, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port())), 120)
    assert res.returncode != 0 and not res.leftovers
    assert res.stderr.startswith("a rank never started, so the whole run was stopped:\n"
                                 "  rank 1 never joined: the others waited "
                                 "trainer.dist_timeout_s=5 s for it at 127.0.0.1:"), res.output
    assert res.stderr.count("\n") == 2 and "Traceback" not in res.output, res.output
    assert run_dirs(workdir / "outputs") == []
    assert time.time() - started < 60


@pytest.fixture(scope="session")
def mpirun() -> str:
    """OpenMPI's mpirun, installed with apt-get where it is missing (as root)."""
    found = shutil.which("mpirun")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        from helpers.host import apt_lock

        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        with apt_lock():
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
            subprocess.run(["apt-get", "install", "-y", "-qq", "openmpi-bin"], env=env,
                           capture_output=True, timeout=600)
        found = shutil.which("mpirun")
    if found is None:
        pytest.skip("OpenMPI's mpirun is missing and could not be installed (needs root and apt-get)")
    return found


@pytest.mark.host
def test_mpirun_is_one_run(workdir, mpirun):
    res = finish(start([mpirun, "-np", "2", "--allow-run-as-root", "--oversubscribe",
                        sys.executable, "-m", "ddpexp", *TINY], workdir), 240)
    assert res.returncode == 0, res.output
    assert not res.leftovers
    assert "2 worker(s) (MPI ranks)" in res.output
    # mpirun binds each of the 2 ranks to a core of its own: they do not share one.
    assert "CPU workers on" not in res.output or len(os.sched_getaffinity(0)) < 2, res.output
    one_run(workdir, 2)


@pytest.mark.host
def test_a_rank_sigkilled_under_mpirun_is_named_and_recorded(workdir, mpirun):
    """Rank 1 SIGKILLed at its 6th forward (epoch 1): mpirun then SIGKILLs rank 0 two
    seconds later, by which time rank 0 has named the rank and marked the run failed."""
    res = finish(start([mpirun, "-np", "2", "--allow-run-as-root", "--oversubscribe",
                        sys.executable, "-m", "ddpexp", *TINY, "model._target_=faulty.Faulty",
                        "+model.mode=kill", "+model.at_call=6"], workdir), 240)
    assert res.returncode != 0
    assert not res.leftovers
    assert ("a worker failed, so the whole run was stopped:\n  rank 1 died without a Python "
            "error (killed by a signal") in res.stderr, res.output
    metrics = read_metrics(only_run_dir(workdir))
    assert metrics["status"] == "failed" and "rank 1 died" in metrics["error"], metrics


def test_a_raising_rank_under_torchrun_is_named_and_recorded(workdir):
    started = time.time()
    res = finish(start([*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        f"--master-port={free_port()}", "-m", "ddpexp", *TINY,
                        "model._target_=faulty.Faulty", "+model.mode=raise"], workdir), 240)
    assert res.returncode != 0
    assert not res.leftovers
    assert "a worker failed, so the whole run was stopped:" in res.stderr, res.output
    assert "rank 1 (pid" in res.stderr and "RuntimeError: injected failure on rank 1" in res.stderr
    # ddpexp's ranks print no traceback of their own (torchrun's agent prints its report).
    assert "File \"" not in res.stderr.split("a worker failed")[0]
    run_dir = only_run_dir(workdir)
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "failed" and "injected failure on rank 1" in metrics["error"]
    assert time.time() - started < 180


def test_a_rank_failing_before_training_under_torchrun_still_gets_rank_0s_message(workdir):
    """Rank 1 raises in its first forward (the probe batch, before any collective) and exits;
    torchrun's agent then SIGTERMs rank 0, still building its trainer. Rank 0 ignores that
    signal (another rank has failed: the launcher is ending every rank) and writes the run's
    message and record (it died of the SIGTERM, silent, about one time in two before)."""
    res = finish(start([*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        f"--master-port={free_port()}", "-m", "ddpexp", *TINY,
                        "model._target_=faulty.Faulty", "+model.mode=raise",
                        "+model.at_call=1"], workdir), 240)
    assert res.returncode != 0
    assert not res.leftovers
    assert "a worker failed, so the whole run was stopped:" in res.stderr, res.output
    assert "RuntimeError: injected failure on rank 1" in res.stderr
    metrics = read_metrics(only_run_dir(workdir))
    assert metrics["status"] == "failed" and "injected failure on rank 1" in metrics["error"]


def test_torchrun_restart_resumes_the_same_run_dir(workdir):
    # Rank 1 is SIGKILLed at its 5th forward (epoch 1, after epoch 0's checkpoint), in the
    # first round only; the agent restarts both workers, which continue the same run. The
    # checkpoint is written in the loop: a background write of epoch 0's could still be
    # under way when the agent stops rank 0 (a loaded CI restarted from scratch).
    res = finish(start([*TORCHRUN, "--nproc-per-node=2", "--max-restarts=1",
                        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                        "-m", "ddpexp", *TINY, "trainer.max_epochs=3", "trainer.async_save=false",
                        "model._target_=faulty.Faulty", "+model.mode=kill", "+model.at_call=5",
                        "+model.first_attempt_only=true"], workdir), 300)
    assert res.returncode == 0, res.output
    assert not res.leftovers
    run_dir = only_run_dir(workdir)
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed" and metrics["epochs"] == 3
    log = (run_dir / "ddpexp.log").read_text()
    assert "restart 1 of the worker group: resuming from" in log and "last.pt" in log
    assert [h["epoch"] for h in metrics["history"]] == [0, 1, 2]


def test_ctrl_c_under_torchrun_is_an_interruption_with_torchruns_own_resume_command(workdir):
    """Ctrl-C to torchrun's process group once a checkpoint is saved: ddpexp says the run
    was stopped by SIGINT (no worker failure) with the command that continues it, torchrun
    and every flag of it kept; pasted as printed, that command finishes the run."""
    port = free_port()
    launcher = [*TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={port}", "-m", "ddpexp"]
    proc = start([*launcher, *TINY, "trainer.max_epochs=50", "trainer.ckpt_every_steps=3"],
                 workdir)
    deadline = time.time() + 180
    while not list((workdir / "outputs").glob("*/*/checkpoints/last.pt")):
        assert proc.poll() is None and time.time() < deadline, finish(proc, 10).output
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    res = finish(proc, 90)
    assert res.returncode != 0 and not res.leftovers
    assert "stopped by SIGINT; the last checkpoint is in" in res.stderr, res.output
    assert "workers failed" not in res.output and "SystemExit" not in res.output, res.output
    run_dir = only_run_dir(workdir)
    assert read_metrics(run_dir)["status"] == "interrupted"
    printed = res.stderr.split("Continue it with:\n", 1)[1].splitlines()[0].strip()
    # The interpreter as PATH finds it, where it finds this one.
    name = Path(sys.executable).name
    python = name if shutil.which(name) == sys.executable else sys.executable
    assert printed.startswith(f"{python} -m torch.distributed.run --nproc-per-node=2 "
                              f"--master-addr=127.0.0.1 --master-port={port} -m ddpexp "
                              f"resume={run_dir} "), printed
    again = run_printed(printed, workdir, 240, {"PYTHONPATH": os.pathsep.join(
        filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))})
    assert "resumed from" in again.output
    assert read_metrics(run_dir)["status"] == "completed"
