"""ddpexp's guarantees when SLURM starts the ranks, on a real one-node SLURM cluster
(tests/slurm_cluster.py: munged, slurmctld and slurmd on this machine, one cluster for the
whole session): ``srun`` with one task per rank, and Hydra's ``submitit_slurm`` launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import slurm_cluster
import torch
from helpers import finish, read_metrics, read_scalars, wait_for
from test_checkpoint_resume import assert_same_final_state
from test_checkpoint_signals import LONG

# The session's cluster apt-gets munge and slurm where they are missing (slurm_cluster.install).
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.host]

PLUGINS = str(Path(__file__).parents[1] / "plugins")
# 256 train samples: 2 batches of 64 per rank and epoch at world size 2.
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
        "data.val_samples=101", "model=mlp", "model.hidden=[16]", "trainer.log_every_n_steps=1",
        "trainer.max_epochs=2"]
FAULTY = ["model._target_=faulty.Faulty"]


@pytest.fixture(scope="session")
def cluster():
    """One SLURM cluster for every test here, its daemons stopped by PID at the end."""
    try:
        running = slurm_cluster.start()
    except slurm_cluster.Unavailable as exc:
        pytest.skip(f"no SLURM cluster here: {exc}")
    yield running
    running.cancel_all()
    running.stop()


@pytest.fixture
def slurm(cluster):
    """The cluster, checked after each test for jobs it left running (cancelled either way)."""
    yield cluster
    deadline = time.time() + 20  # a job whose processes are still exiting
    while (left := cluster.run("squeue", "-h", "-o", "%i %j %T").stdout.strip()) and time.time() < deadline:
        time.sleep(0.5)
    cluster.cancel_all()
    assert not left, f"jobs left behind: {left}"


def _env(cluster) -> dict:
    env = cluster.env()
    env.pop("HYDRA_FULL_ERROR", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PLUGINS, env.get("PYTHONPATH")]))
    return env


def start(cluster, cmd: list[str], cwd: Path) -> subprocess.Popen:
    """A client command (srun, salloc, the CLI that submits) in a session of its own."""
    return subprocess.Popen(cmd, cwd=cwd, env=_env(cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def srun_cmd(args: list[str], *opts: str) -> list[str]:
    return ["srun", "--ntasks=2", "--ntasks-per-node=2", *opts, sys.executable, "-m", "ddpexp",
            *args]


def srun(cluster, args: list[str], cwd: Path, *opts: str, timeout: float = 120, ok: bool = True):
    """``srun --ntasks-per-node=2 python -m ddpexp ARGS`` to its end."""
    res = finish(start(cluster, srun_cmd(args, *opts), cwd), timeout)
    assert not res.leftovers, res.leftovers
    if ok:
        assert res.returncode == 0, res.output
    return res


def cli(cluster, args: list[str], cwd: Path, timeout: float = 180, ok: bool = True):
    """``python -m ddpexp ARGS`` outside any allocation (a submitit sweep's submitting side)."""
    res = finish(start(cluster, [sys.executable, "-m", "ddpexp", *args], cwd), timeout)
    assert not res.leftovers, res.leftovers
    if ok:
        assert res.returncode == 0, res.output
    return res


def job_id(cluster, name: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = cluster.run("squeue", "-h", "-n", name, "-o", "%i").stdout.split()
        if found:
            return found[0]
        time.sleep(0.2)
    pytest.fail(f"job {name} never showed in squeue")


def test_srun_two_tasks_one_run_guarded_dir(slurm, tmp_path):
    """Two tasks form one world of 2 ranks: one run dir, Hydra's files and each log line once,
    one writer. The same run dir again is refused. (trainer.procs that disagree with the tasks:
    tests/unit/test_slurm_plan.py, in-process.)"""
    # outputs/job_$SLURM_JOB_ID as the login shell expands it before srun starts the job.
    run_dir = tmp_path / "outputs" / "job_"
    res = srun(slurm, [*TINY, f"hydra.run.dir={run_dir}"], tmp_path)
    m = read_metrics(run_dir)
    assert m["status"] == "completed" and m["world_size"] == 2 and m["epochs"] == 2
    assert res.output.count("2 worker(s) (SLURM tasks): strategy=ddp, CPU") == 1
    log = (run_dir / "ddpexp.log").read_text()
    assert log.count("run dir: ") == 1 and log.count("completed: 2 epochs") == 1
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == [
        "config.yaml", "hydra.yaml", "overrides.yaml"]  # no resume-N of a second task
    assert len(list((run_dir / "tb").iterdir())) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # no dir of a second task

    before = (run_dir / "metrics.json").read_bytes()
    again = srun(slurm, [*TINY, f"hydra.run.dir={run_dir}"], tmp_path, ok=False)
    assert again.returncode != 0 and "Traceback" not in again.output
    assert again.stderr.count("already holds a run") == 1, again.stderr
    assert f"resume={run_dir}" in again.stderr
    assert (run_dir / "metrics.json").read_bytes() == before


@pytest.mark.parametrize("rank", [1])  # rank 0 failing: test_rank_0_killed_under_srun_is_named_and_recorded_by_rank_1
def test_rank_raising_under_srun_is_one_message_and_a_failed_record(slurm, tmp_path, rank):
    """Rank 1 raises: rank 0 names it from the step's store. Rank 0 raises: it names itself,
    and the other task, whose store went away with it, stays silent."""
    run_dir = tmp_path / "outputs" / "raise"
    started = time.time()
    res = srun(slurm, [*TINY, *FAULTY, "+model.mode=raise", f"+model.rank={rank}",
                       f"hydra.run.dir={run_dir}"], tmp_path, ok=False)
    assert time.time() - started < 60
    assert res.returncode != 0
    assert "Traceback" not in res.output and "frame #" not in res.output, res.output
    assert re.search(rf"a worker failed, so the whole SLURM step was stopped:\n  rank {rank} \(pid "
                     rf"\d+\) raised RuntimeError: injected failure on rank {rank}\n", res.stderr), res.stderr
    assert res.stderr.count("injected failure") == 1
    m = read_metrics(run_dir)
    assert m["status"] == "failed" and f"rank {rank}" in m["error"] and "injected failure" in m["error"]
    log = (run_dir / "ddpexp.log").read_text()
    assert f"[rank{rank}] worker failed" in log and "Traceback" in log


def test_rank_0_killed_under_srun_is_named_and_recorded_by_rank_1(slurm, tmp_path):
    """SIGKILL takes rank 0 and the step's store with it: rank 1, the next one, says so once
    and marks the run failed."""
    run_dir = tmp_path / "outputs" / "killed"
    res = srun(slurm, [*TINY, *FAULTY, "+model.mode=kill", "+model.rank=0",
                       f"hydra.run.dir={run_dir}"], tmp_path, ok=False)
    assert res.returncode != 0 and "Traceback" not in res.output and "frame #" not in res.output
    assert res.stderr.count("a worker failed, so the whole SLURM step was stopped:\n  rank 0 died "
                            "without a Python error (killed by a signal") == 1, res.stderr
    m = read_metrics(run_dir)
    assert m["status"] == "failed" and "rank 0 died" in m["error"]


@pytest.mark.parametrize("rank", [1])
def test_stalled_rank_under_srun_ends_the_step_without_kill_on_bad_exit(slurm, tmp_path, rank):
    """A rank hangs in its forward; the other's collective times out after dist_timeout_s and
    the step ends (no srun -K1) with the stalled rank named and its stack in the log. Rank 0
    stalled: it still writes the record and the message."""
    run_dir = tmp_path / "outputs" / "stall"
    timeout_s = 5
    started = time.time()
    res = srun(slurm, [*TINY, *FAULTY, "+model.mode=stall", f"+model.rank={rank}",
                       f"trainer.dist_timeout_s={timeout_s}", f"hydra.run.dir={run_dir}"], tmp_path,
               ok=False, timeout=timeout_s + 60)
    took = time.time() - started
    assert took < timeout_s + 40, took
    assert res.returncode != 0 and "Traceback" not in res.output, res.output
    assert re.search(rf"a worker stalled, so the whole SLURM step was stopped:\n  rank {rank} \(pid "
                     rf"\d+\) stalled: no progress while the others waited trainer.dist_timeout_s=5 s",
                     res.stderr), res.stderr
    assert res.output.count("a worker stalled") == 1
    assert f"its Python stack is in {run_dir}/ddpexp.log" in res.stderr
    stack = (run_dir / "ddpexp.log").read_text().split(f"[rank{rank}] stalled while", 1)[1]
    assert "most recent call first" in stack and "faulty.py" in stack and "in forward" in stack
    m = read_metrics(run_dir)
    assert m["status"] == "failed" and f"rank {rank} (pid" in m["error"]


def test_two_srun_steps_side_by_side_in_one_allocation(slurm, tmp_path):
    """Two 2-task steps at once in a 4-task allocation: each step its own port, both complete."""
    a, b = tmp_path / "outputs" / "a", tmp_path / "outputs" / "b"
    step = " ".join(srun_cmd(TINY, "--exact"))
    script = (f"{step} hydra.run.dir={a} & first=$!; {step} hydra.run.dir={b} & second=$!; "
              "wait $first; a=$?; wait $second; exit $((a | $?))")
    res = finish(start(slurm, ["salloc", "--ntasks=4", "bash", "-c", script], tmp_path), 180)
    assert not res.leftovers and res.returncode == 0, res.output
    for run_dir in (a, b):
        assert read_metrics(run_dir)["status"] == "completed"
    spans = [_span(d / "ddpexp.log") for d in (a, b)]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans  # they overlapped


def _span(log: Path) -> tuple[str, str]:
    stamps = re.findall(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\]", log.read_text(), re.M)
    return stamps[0], stamps[-1]


def test_scancel_then_resume_continues_exactly(slurm, tmp_path):
    """scancel stops both ranks at a step with a checkpoint; the printed command (with its
    srun) continues the run to the state an uninterrupted run of that length reaches."""
    run_dir = tmp_path / "outputs" / "cancelled"
    name = f"ddpexp-{uuid.uuid4().hex[:8]}"
    proc = start(slurm, srun_cmd([*LONG, "trainer.max_epochs=100000", f"hydra.run.dir={run_dir}"],
                                 f"--job-name={name}"), tmp_path)
    wait_for(run_dir / "checkpoints" / "last.pt", proc)
    slurm.run("scancel", job_id(slurm, name, proc))
    res = finish(proc, 60)
    assert res.returncode != 0 and "Traceback" not in res.output, res.output
    assert "SIGTERM: stopped at epoch" in res.output
    hint = f"srun --ntasks-per-node=2 python -m ddpexp resume={run_dir}"
    assert hint in res.stderr, res.stderr
    m = read_metrics(run_dir)
    assert m["status"] == "interrupted"
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["step"] == m["steps"] > 0 and ckpt["world_size"] == 2

    length = f"trainer.max_epochs={ckpt['epoch'] + 2}"
    resumed = srun(slurm, [*LONG, length, f"resume={run_dir}"], tmp_path)
    assert "resumed from" in resumed.output
    reference = tmp_path / "outputs" / "reference"
    srun(slurm, [*LONG, length, f"hydra.run.dir={reference}"], tmp_path)
    assert_same_final_state(run_dir, reference)


SUBMITIT = ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=5"]


def test_submitit_sweep_has_its_summary_and_its_dir_is_guarded(slurm, tmp_path):
    """A sweep of 2 jobs of 2 tasks each through submitit_slurm: a run dir per job and
    summary.csv/md (by seed too) as under ddpexp's own launcher; the same sweep dir again is
    refused."""
    sweep = tmp_path / "sweep"
    res = cli(slurm, [*SUBMITIT, "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={sweep}",
                      *TINY, "seed=0,1"], tmp_path)
    for job in ("0", "1"):
        m = read_metrics(sweep / job)
        assert m["status"] == "completed" and m["world_size"] == 2  # a rank per task
        assert read_scalars(sweep / job / "tb")["val/acc"]
        # Every task ran Hydra's job; its files and the log's lines are there once.
        assert sorted(p.name for p in (sweep / job / ".hydra").iterdir()) == [
            "config.yaml", "hydra.yaml", "overrides.yaml"]
        assert (sweep / job / "ddpexp.log").read_text().count("run dir: ") == 1
    summary = (sweep / "summary.csv").read_text().splitlines()
    assert len(summary) == 3 and all(",completed," in line for line in summary[1:]), summary
    assert (sweep / "summary.md").exists()
    assert "n" in (sweep / "summary_by_seed.csv").read_text().splitlines()[0].split(",")
    assert "sweep summary (" in res.output

    name = f"ddpexp-{uuid.uuid4().hex[:8]}"
    again = cli(slurm, [*SUBMITIT, f"hydra.launcher.name={name}", f"hydra.sweep.dir={sweep}",
                        *TINY, "seed=0,1"], tmp_path, ok=False, timeout=60)
    assert again.returncode != 0 and "Traceback" not in again.output
    assert "already holds 2 run(s) of an earlier sweep" in again.stderr, again.stderr
    assert not slurm.run("squeue", "-h", "-n", name).stdout.strip()  # nothing was submitted


# submitit polls a job's state at intervals that double (2, 3, 6, 12, 24, 48, 96 s): on a
# loaded machine the requeued job may end just after a poll, and the next comes 96 s later;
# the wait below covers two such polls after the release (one was not enough on a CI run).
@pytest.mark.timeout(600)
def test_submitit_pre_timeout_signal_requeues_and_the_job_completes(slurm, tmp_path):
    """SIGUSR2, the signal SLURM sends signal_delay_s before the time limit (delivered here by
    scancel --signal): ddpexp checkpoints, submitit requeues the job (ddpexp's default
    max_num_timeout), and the requeued job continues from the checkpoint and completes."""
    sweep = tmp_path / "sweep"
    name = f"ddpexp-{uuid.uuid4().hex[:8]}"
    proc = start(slurm, [sys.executable, "-m", "ddpexp", *SUBMITIT, f"hydra.launcher.name={name}",
                         f"hydra.sweep.dir={sweep}", *LONG, "trainer.max_epochs=20"], tmp_path)
    wait_for(sweep / "0" / "checkpoints" / "last.pt", proc)
    job = job_id(slurm, name, proc)
    slurm.run("scancel", "--signal=USR2", job)
    # SLURM holds a requeued job for two minutes before it may start again; let it go now.
    deadline, released = time.time() + 90, False
    while time.time() < deadline and proc.poll() is None:
        state = slurm.run("squeue", "-h", "-j", job, "-o", "%T %r").stdout.split()
        if state[:2] == ["PENDING", "BeginTime"]:
            released = slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0
        time.sleep(0.5)
    res = finish(proc, 300)
    assert released, "the job was never requeued"
    assert not res.leftovers and res.returncode == 0, res.output
    log = (sweep / "0" / "ddpexp.log").read_text()
    assert "SIGUSR2: stopped at epoch" in log
    assert "handing the signal to submitit to requeue the job" in log
    assert f"requeued submitit job: continuing {sweep}/0/checkpoints/last.pt" in log
    m = read_metrics(sweep / "0")
    assert m["status"] == "completed" and m["epochs"] == 20
    assert ",completed," in (sweep / "summary.csv").read_text()
