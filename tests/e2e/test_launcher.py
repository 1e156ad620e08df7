"""Sweeps end to end through the CLI: every job a real process (and real DDP workers)."""

from __future__ import annotations

import csv
import itertools
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from helpers import finish, read_metrics, run_cli, run_printed, start_cli

pytestmark = pytest.mark.slow

# Tiny runs: a few steps on a small synthetic dataset.
TINY = ["data=synthetic", "data.num_samples=64", "data.val_samples=32", "data.shape=[1,8,8]",
        "data.batch_size=16", "trainer.max_steps=2", "trainer.log_every_n_steps=1"]


def sweep(workdir: Path, *overrides: str, expect_ok: bool = True, timeout: float = 300):
    """Run ``python -m ddpexp -m`` into ``workdir/sweep``; returns (result, sweep dir)."""
    sweep_dir = workdir / "sweep"
    res = run_cli(["-m", *TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"], workdir,
                  timeout=timeout, expect_ok=expect_ok)
    return res, sweep_dir


def summary_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def test_2x2_sweep_of_ddp_runs(workdir: Path) -> None:
    # Two jobs at a time (one core each on CI) keeps the test short.
    res, sweep_dir = sweep(workdir, "optimizer.lr=0.01,0.1", "data.batch_size=8,16",
                           "trainer.procs=2", "hydra.launcher.max_parallel=2")
    dirs = job_dirs(sweep_dir)
    assert [d.name for d in dirs] == ["0", "1", "2", "3"]
    for d in dirs:
        for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "ddpexp.log",
                     "checkpoints/last.pt", "checkpoints/best.pt"):
            assert (d / name).is_file(), d / name
        assert list((d / "tb").glob("events.out.tfevents.*")), d
        metrics = read_metrics(d)
        assert metrics["status"] == "completed" and metrics["world_size"] == 2
    # The sweep never re-ran itself: no run dirs other than the 4 jobs.
    assert not (workdir / "outputs").exists()

    rows = summary_rows(sweep_dir)
    assert len(rows) == 4
    by_job = {r["job"]: r for r in rows}
    for d in dirs:
        metrics, row = read_metrics(d), by_job[d.name]
        assert row["status"] == "completed"
        assert float(row["best"]) == pytest.approx(metrics["best"]["val/acc"])
        assert float(row["final"]) == pytest.approx(metrics["final"]["val/acc"])
        assert int(row["steps"]) == 2
        assert row["overrides"].split() == yaml.safe_load((d / ".hydra/overrides.yaml").read_text())
    # Later overrides win, as in Hydra: each job got one of the 4 combinations.
    chosen = {(dict(o.split("=", 1) for o in r["overrides"].split())["optimizer.lr"],
               dict(o.split("=", 1) for o in r["overrides"].split())["data.batch_size"])
              for r in rows}
    assert chosen == set(itertools.product(("0.01", "0.1"), ("8", "16")))
    bests = [float(r["best"]) for r in rows]
    assert bests == sorted(bests, reverse=True)  # best job first
    md = (sweep_dir / "summary.md").read_text()
    assert md.startswith("| job | overrides | status | final val/acc | best val/acc |")
    assert md.count("| completed |") == 4
    assert "best val/acc" in res.stdout and res.stdout.count("completed  ") >= 4
    _each_jobs_console_lines_carry_its_number(res.stdout + res.stderr, sweep_dir, 4)


def _each_jobs_console_lines_carry_its_number(output: str, sweep_dir: Path, jobs: int) -> None:
    """Jobs that ran at once: every console line of a job, its own process's ("run dir: ...")
    and its workers' ("epoch 0 ..."), starts with its #N; the launcher's own lines are as
    Hydra writes them, and the jobs' log files stay untagged."""
    job_line = re.compile(r"^(#\d+ )?\[\d{4}-\d\d-\d\d [\d:,]+\]\[(?!HYDRA\])")
    lines = [line for line in output.splitlines() if job_line.match(line)]
    assert lines and all(re.match(r"#\d+ \[", line) for line in lines), lines
    for n in range(jobs):
        own = [line for line in lines if line.startswith(f"#{n} [")]
        assert any(line.endswith(f"run dir: {sweep_dir / str(n)}") for line in own), lines
        assert any("][ddpexp][INFO] - epoch 0" in line for line in own), lines
        log = (sweep_dir / str(n) / "ddpexp.log").read_text()
        assert log.startswith("[") and "\n#" not in log


JOB_LINE = re.compile(r"job (\d+): pid (\d+), .*process group (\d+), "
                      r"(forked from the fork server \(pid (\d+)\)|a fresh interpreter)")


def _job_lines(sweep_dir: Path) -> dict[str, re.Match]:
    found = {}
    for d in job_dirs(sweep_dir):
        match = JOB_LINE.search((d / "ddpexp.log").read_text())
        assert match, (d / "ddpexp.log").read_text()
        found[d.name] = match
    return found


def test_jobs_are_forked_each_in_its_own_process_and_group(workdir: Path) -> None:
    """Jobs come from one pre-imported server, each its own process leading its own
    process group, and one config (0.1 and 0.10 are the same lr) on equal slices trains
    bitwise the same weights."""
    import torch
    from helpers import assert_same_tensors

    _, sweep_dir = sweep(workdir, "optimizer.lr=0.1,0.10")
    lines = _job_lines(sweep_dir)
    pids = {m.group(2) for m in lines.values()}
    assert len(pids) == 2
    for m in lines.values():
        assert m.group(3) == m.group(2), "a job leads its own process group"
        assert m.group(5), f"job {m.group(1)} was not forked: {m.group(0)}"
    servers = {m.group(5) for m in lines.values()}
    assert len(servers) == 1 and not pids & servers
    weights = [torch.load(sweep_dir / j / "checkpoints" / "last.pt", weights_only=True)["model"]
               for j in ("0", "1")]
    assert_same_tensors(weights[0], weights[1], "model")
    assert read_metrics(sweep_dir / "0")["history"] == read_metrics(sweep_dir / "1")["history"]


def test_the_jobs_fork_from_the_server_the_command_started_first(workdir: Path, monkeypatch,
                                                                capsys) -> None:
    """``python -m ddpexp -m`` (its cli, in this process) starts the fork server before Hydra
    runs, and the launcher forks the jobs from that one rather than starting its own."""
    from helpers.cli import run_cli_here

    from ddpexp.sweep import forkserver

    started = []
    real_start = forkserver.start_early

    def start_early(argv):
        real_start(argv)
        if forkserver._EARLY is not None and forkserver._EARLY.proc is not None:
            started.append(str(forkserver._EARLY.proc.pid))

    monkeypatch.setattr(forkserver, "start_early", start_early)
    sweep_dir = workdir / "sweep"
    code, output = run_cli_here(["-m", *TINY, "seed=0,1", f"hydra.sweep.dir={sweep_dir}"],
                                workdir, monkeypatch, capsys)
    assert code == 0, output
    assert len(started) == 1
    assert {m.group(5) for m in _job_lines(sweep_dir).values()} == set(started)
    assert forkserver._EARLY is None


PRELOAD_WITH_A_THREAD = """import threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True, name="user-thread").start()
"""


def test_a_fork_server_with_a_thread_falls_back_to_fresh_interpreters(workdir: Path) -> None:
    (workdir / "threaded_at_import.py").write_text(PRELOAD_WITH_A_THREAD)
    res, sweep_dir = sweep(workdir, "seed=0,1", "hydra.launcher.preload=[threaded_at_import]")
    warnings = [ln for ln in res.output.splitlines() if "fresh interpreter each" in ln]
    assert len(warnings) == 1, res.output
    assert "Python threads besides its main one (user-thread)" in warnings[0]
    for m in _job_lines(sweep_dir).values():
        assert m.group(4) == "a fresh interpreter" and m.group(3) == m.group(2)
    assert [r["status"] for r in summary_rows(sweep_dir)] == ["completed", "completed"]


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def _log_span(log: Path) -> tuple[datetime, datetime]:
    stamps = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
              for m in map(LOG_TIME.match, log.read_text().splitlines()) if m]
    return stamps[0], stamps[-1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_the_default_packs_jobs_of_one_and_two_workers_without_sharing_a_core(workdir: Path) -> None:
    """``max_parallel: null``: each job takes a free core per worker and starts as soon as
    they are free, so two 1-worker jobs run side by side and the 2-worker job gets two cores
    of its own; no two jobs that run at the same time share a core."""
    res, sweep_dir = sweep(workdir, "trainer.procs=1,1,2", "trainer.max_steps=8")
    machine = set(os.sched_getaffinity(0))
    assert f"as many at once as {len(machine)} cores hold" in res.output
    jobs = []
    for d in job_dirs(sweep_dir):
        metrics = read_metrics(d)
        assert metrics["status"] == "completed"
        log = (d / "ddpexp.log").read_text()
        # Logged by the job process itself from os.sched_getaffinity.
        found = re.search(r"job \d+: pid \d+, cores ([\d,]+), OMP_NUM_THREADS=(\d+)", log)
        assert found, log
        job_cores = {int(c) for c in found.group(1).split(",")}
        assert len(job_cores) == metrics["world_size"] == int(found.group(2))
        assert job_cores <= machine
        jobs.append((job_cores, _log_span(d / "ddpexp.log")))
    assert [len(c) for c, _ in jobs] == [1, 1, 2]
    # The launcher started job 1 while job 0 held its core (the order of its own lines; the
    # jobs' logs alone can miss a tiny job's overlap), and the 2-worker job on 2 cores only
    # once both had ended.
    out = res.output
    assert out.index("\t#1 : ") < out.index("\t#0 ended"), out
    if len(machine) == 2:
        assert out.index("\t#2 : ") > max(out.index("\t#0 ended"), out.index("\t#1 ended")), out
    overlap = {(i, j) for (i, (_, (s0, e0))), (j, (_, (s1, e1))) in
               itertools.combinations(enumerate(jobs), 2) if s0 < e1 and s1 < e0}
    for i, j in overlap:
        assert not jobs[i][0] & jobs[j][0], f"jobs {i} and {j} shared a core: {jobs}"


def test_failing_jobs_do_not_stop_the_others(workdir: Path) -> None:
    # max_epochs=0 fails ddpexp's config check, momentum=-1 fails in torch: both in the job.
    res, sweep_dir = sweep(workdir, "trainer.max_epochs=1,0", "optimizer.momentum=0.9,-1",
                           "hydra.launcher.max_parallel=2", expect_ok=False)
    assert res.returncode != 0
    assert read_metrics(sweep_dir / "0")["status"] == "completed"
    rows = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert [rows[j]["status"] for j in "0123"] == ["completed", "failed", "failed", "failed"]
    assert "Invalid momentum value" in rows["1"]["error"]
    assert "trainer.max_epochs=0 must be >= 1" in rows["2"]["error"]
    assert "optimizer.momentum=-1" in rows["1"]["overrides"]
    assert "3 of 4 job(s) failed" in res.output
    listed = res.output.split("3 of 4 job(s) failed", 1)[1]
    for job, overrides in (("#1 : ", "trainer.max_epochs=1 optimizer.momentum=-1"),
                           ("#2 : ", "trainer.max_epochs=0 optimizer.momentum=0.9"),
                           ("#3 : ", "trainer.max_epochs=0 optimizer.momentum=-1")):
        line = next(ln for ln in listed.splitlines() if ln.strip().startswith(job))
        assert line.endswith(overrides)
    # The torch error's traceback is in the job's log, not on the terminal.
    assert "Traceback" in (sweep_dir / "1" / "ddpexp.log").read_text()
    assert "Traceback" not in res.stderr


def test_fail_fast_stops_launching(workdir: Path) -> None:
    res, sweep_dir = sweep(workdir, "trainer.max_epochs=0,1", "hydra.launcher.fail_fast=true",
                           "hydra.launcher.max_parallel=1", expect_ok=False)
    assert res.returncode != 0
    assert not (sweep_dir / "1").exists()
    rows = {r["job"]: r for r in summary_rows(sweep_dir)}
    # Never started: "not run", and not counted among the failures.
    assert rows["1"]["status"] == "not run" and "fail_fast" in rows["1"]["error"]
    assert "1 of 2 job(s) failed" in res.output and "1 of 2 job(s) not run" in res.output


def test_submitit_local_sweep_fans_out_workers(workdir: Path) -> None:
    _, sweep_dir = sweep(workdir, "hydra/launcher=submitit_local", "trainer.procs=1,2")
    dirs = job_dirs(sweep_dir)
    assert [d.name for d in dirs] == ["0", "1"]
    assert [read_metrics(d)["world_size"] for d in dirs] == [1, 2]
    assert all(read_metrics(d)["status"] == "completed" for d in dirs)
    # The sweep's table, which submitit knows nothing of (ddpexp's SweepSummary callback).
    rows = summary_rows(sweep_dir)
    assert sorted(r["job"] for r in rows) == ["0", "1"] and {r["status"] for r in rows} == {"completed"}
    assert (sweep_dir / "summary.md").exists()


def _mtimes(job_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(job_dir)): p.stat().st_mtime_ns
            for p in job_dir.rglob("*") if p.is_file()}


def test_interrupted_sweep_resumes(workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    # Job 1 is long enough to be stopped mid-run; each epoch is 16 steps.
    args = ["-m", *TINY, "data.num_samples=256", "trainer.max_epochs=100",
            "trainer.max_steps=2,300,2", "hydra.launcher.max_parallel=1",
            f"hydra.sweep.dir={sweep_dir}"]
    proc = start_cli(args, workdir)
    deadline = time.time() + 240
    while not (sweep_dir / "1" / "checkpoints" / "last.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "job 1 never saved a checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the sweep stops its jobs with SIGTERM
    res = finish(proc, timeout=120)
    assert not res.leftovers
    assert res.returncode == 130 and "resume=auto" in res.output  # 128 + SIGINT
    assert "HYDRA_FULL_ERROR" not in res.output  # ddpexp's message alone
    assert read_metrics(sweep_dir / "0")["status"] == "completed"
    assert read_metrics(sweep_dir / "1")["status"] == "interrupted"
    assert not (sweep_dir / "2").exists()
    # The stopped job is called interrupted, by the signal it got, never failed.
    assert "#1 ended (interrupted by SIGTERM)" in res.output
    assert "1 of 3 job(s) interrupted" in res.output and "the sweep was stopped by SIGINT" in res.output
    assert not re.search(r"fail", res.output, re.I), res.output
    rows = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert [rows[j]["status"] for j in "012"] == ["completed", "interrupted", "not run"]
    # Wall time is the job's as the launcher saw it, start-up included; train time is less.
    seen = float(re.search(r"#0 ended \(completed\) after ([\d.]+) s", res.output).group(1))
    wall, train = float(rows["0"]["wall_time_s"]), float(rows["0"]["train_time_s"])
    assert seen - 1.0 < wall <= seen + 0.05 and train < wall
    before = _mtimes(sweep_dir / "0")

    # The command it printed, run as it is, finishes the sweep.
    printed = res.output.split("To finish it, run:\n", 1)[1].splitlines()[0].strip()
    assert res.output.count(printed) == 2  # the stopped job's own message says the same
    res = run_printed(printed, workdir, timeout=300)
    assert _mtimes(sweep_dir / "0") == before  # the completed job was not touched
    assert "completed before, not run again" in res.output
    m1 = read_metrics(sweep_dir / "1")
    assert m1["status"] == "completed" and m1["steps"] == 300
    assert (sweep_dir / "1" / ".hydra" / "resume-1" / "config.yaml").is_file()
    assert read_metrics(sweep_dir / "2")["status"] == "completed"
    assert (f"resume=auto: no checkpoint in {sweep_dir}/2/checkpoints, starting from scratch"
            in (sweep_dir / "2" / "ddpexp.log").read_text())
    rows = summary_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["completed"] * 3
    # Job 2 first ran in the resumed sweep, with its resume=auto: not one of its overrides.
    rows = {r["job"]: r for r in rows}
    assert "resume=auto" in (sweep_dir / "2" / ".hydra" / "overrides.yaml").read_text()
    assert rows["2"]["overrides"] == rows["0"]["overrides"] and "resume" not in rows["2"]["overrides"]


def test_a_job_killed_while_the_sweep_stops_is_interrupted(tmp_path: Path, caplog) -> None:
    """A job process that dies of the launcher's SIGTERM before it could report (still
    starting, say) was interrupted with the sweep: its row and the log say so."""
    import subprocess
    import sys

    from ddpexp.sweep import driver, local
    from ddpexp.sweep.backend import HydraSetup, Job
    from ddpexp.sweep.settings import LocalSettings, Sweep
    from ddpexp.sweep.summary import summarize

    settings = LocalSettings(kill_grace_s=30)
    hydra = HydraSetup(None, None, None)  # type: ignore[arg-type]  # the job is started by hand
    backend = local.LocalBackend(settings, hydra)
    job = Job(idx=1, overrides=["seed=1"], dir=tmp_path / "1")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            process_group=0)
    job.handle = local.Process(proc, ([], []), [str(tmp_path / "spec"), str(tmp_path / "result")])
    job.started = time.time()
    backend.running.append(job)
    sweep = driver.Driver(Sweep(settings, hydra, "ddp", lambda: backend), backend)
    sweep.running.append(job)
    sweep._signals.signal_name = "SIGINT"  # what its handler records on Ctrl-C
    with caplog.at_level("INFO", logger="hydra_plugins.ddpexp_launcher"):
        # Sends SIGTERM to the job's group, then sees its process end.
        assert sweep.wait_any() == [job]
        summarize(hydra.outcomes, [job], tmp_path)
    assert (job.outcome, job.interrupted_by) == ("interrupted", "SIGTERM")
    assert "#1 ended (interrupted by SIGTERM)" in caplog.text
    assert "1 of 1 job(s) interrupted" in caplog.text and "failed" not in caplog.text
    (row,) = summary_rows(tmp_path)
    assert row["status"] == "interrupted" and "killed by SIGTERM" in row["error"]
    assert float(row["wall_time_s"]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_jobs_get_their_own_devices(workdir: Path) -> None:
    import torch

    _, sweep_dir = sweep(workdir, "trainer.gpus=1", "optimizer.lr=0.01,0.1",
                         "hydra.launcher.max_parallel=2")
    seen, spans = [], []
    for d in job_dirs(sweep_dir):
        assert read_metrics(d)["status"] == "completed"
        found = re.search(r"CUDA_VISIBLE_DEVICES=(\S+)", (d / "ddpexp.log").read_text())
        assert found
        seen.append(found.group(1))
        spans.append(_log_span(d / "ddpexp.log"))
    if torch.cuda.device_count() >= 2:
        assert seen[0] != seen[1]
    else:  # one GPU: the second job waited for it
        assert seen[0] == seen[1]
        (_, end0), (start1, _) = sorted(spans)
        assert end0 <= start1


def test_job_over_timeout_is_stopped_and_reported(workdir: Path) -> None:
    # Job 0 ends after one epoch; job 1 would train for hours and must be stopped.
    res, sweep_dir = sweep(workdir, "trainer.max_steps=null", "trainer.max_epochs=1,100000",
                           "hydra.launcher.timeout_s=14", "hydra.launcher.kill_grace_s=10",
                           expect_ok=False)
    assert res.returncode != 0
    assert "ran over hydra.launcher.timeout_s" in res.stderr
    rows = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert rows["0"]["status"] == "completed"
    assert rows["1"]["status"] != "completed"
    # The stopped job still saved where it was, so it can be resumed.
    assert (sweep_dir / "1" / "checkpoints" / "last.pt").is_file()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _rows_so_far(sweep_dir: Path) -> int:
    """The completed rows of the sweep's table so far (it also lists the jobs in flight)."""
    try:
        return sum(r["status"] == "completed" for r in summary_rows(sweep_dir))
    except (FileNotFoundError, csv.Error):
        return 0


def test_forty_tiny_jobs_keep_the_launcher_flat_and_a_sigkill_keeps_the_rows(workdir: Path) -> None:
    """The table is rewritten as each job ends: SIGKILL the launcher half way through a
    40-job sweep and the rows of the jobs that ended are on disk; the launcher's memory
    did not grow with the jobs it ran."""
    import subprocess
    import sys

    from helpers import kill_session

    sweep_dir = workdir / "sweep"
    args = ["-m", *TINY, "data.num_samples=16", "data.val_samples=16", "trainer.max_steps=1",
            f"seed=range({40})", f"hydra.sweep.dir={sweep_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    with open(workdir / "out.txt", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddpexp", *args], cwd=workdir, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 400
        rss = {}
        while len(rss) < 2:
            assert proc.poll() is None and time.time() < deadline, (workdir / "out.txt").read_text()
            done = _rows_so_far(sweep_dir)
            for mark in (5, 20):
                if done >= mark and mark not in rss:
                    rss[mark] = _rss_kib(proc.pid)
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        kill_session(proc.pid)
    rows = summary_rows(sweep_dir)
    # The jobs in flight at the kill (two at most: two run at once) have run dirs without
    # metrics.json ("no metrics") or with the one a run writes as it goes ("running"); every
    # other job started has its completed row.
    done = [r for r in rows if r["status"] == "completed"]
    assert 20 <= len(done) < 40 and len(rows) - len(done) <= 2, rows
    assert {r["status"] for r in rows} <= {"completed", "no metrics", "running", "interrupted"}
    assert sorted(int(r["job"]) for r in rows) == list(range(len(rows)))
    # 15 jobs later, the launcher holds at most a few MiB more (their configs and results).
    assert rss[20] - rss[5] < 20 * 1024, rss
