"""logger=mlflow in real runs: a sweep whose jobs write one SQLite store side by side, each
job one MLflow run equal to its metrics.json (a job refused before training one run marked
FAILED); a tracking server killed mid-run under 1 and 2 workers, which costs the run one
warning and the points it could not send, never its outcome; a run stopped by SIGTERM and
resumed against a server that stays one MLflow run with every point once; four processes
writing one SQLite store at once."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import finish, kill_session, read_metrics, run_cli, run_dirs, start_cli
from test_checkpoint_signals import LONG, check_interrupted, interrupt

from ddpexp.loggers import MLflowLogger, RunInfo, prepare_loggers
from ddpexp.loggers.csv import read_rows

pytest.importorskip("mlflow")

SMALL = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=64",
    "data.val_samples=32", "model=mlp", "model.hidden=[8]", "trainer.max_epochs=2",
    "trainer.log_every_n_steps=2", "trainer.test=false",
]
PLUGINS = str(Path(__file__).parents[1] / "plugins")


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real MLflow tracking server on a free port of 127.0.0.1, its store a SQLite file in
    ``root``; killed (its whole process group) when the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1", "--backend-store-uri",
           f"sqlite:///{root / 'server.db'}", "--default-artifact-root", str(root / "artifacts")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True,
                            # No job runner: it starts seven more processes that each
                            # import MLflow, which these tests never use.
                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
                                 "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the MLflow server on port {port} never answered")
                time.sleep(0.3)
        yield url, proc
    finally:
        kill_session(proc.pid)
        proc.wait(10)


def client(outputs: Path, db: str = "mlflow.db"):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{(outputs / db).resolve()}")


def runs_by_dir(outputs: Path, db: str = "mlflow.db") -> dict[str, object]:
    c = client(outputs, db)
    (experiment,) = [e for e in c.search_experiments() if e.name == "ddpexp"]
    runs = c.search_runs([experiment.experiment_id], max_results=100)
    return {r.data.tags["ddpexp.run_dir"]: r for r in runs}


def history(outputs: Path, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client(outputs).get_metric_history(run.info.run_id, key))


@pytest.mark.slow
def test_a_sweep_of_four_jobs_two_at_once_is_four_runs_in_one_store(workdir):
    # Two jobs train; two are refused before training (a precision there is not), leave no
    # run dir, and still get their MLflow run, marked FAILED with the error.
    res = run_cli(["-m", *SMALL, "optimizer.lr=0.05,0.1", "trainer.precision=32,nope",
                   "hydra.launcher.max_parallel=2", "logger=[tensorboard,mlflow]"], workdir,
                  timeout=240, expect_ok=False)
    assert res.returncode != 0
    outputs = workdir / "outputs"
    jobs = [d for d in run_dirs(outputs) if (d / "metrics.json").is_file()]
    runs = runs_by_dir(outputs)
    assert len(jobs) == 2 and len(runs) == 4
    refused = [r for r in runs.values() if r.data.params["trainer.precision"] == "nope"]
    assert len(refused) == 2
    for run in refused:
        assert run.info.status == "FAILED" and run.data.tags["ddpexp.status"] == "failed"
        assert "trainer.precision='nope' is not one of" in run.data.tags["ddpexp.error"]
    for job in jobs:
        run, metrics = runs[str(job.resolve())], read_metrics(job)
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        assert run.data.params["optimizer.lr"] == str(config["optimizer"]["lr"])
        assert run.data.tags["ddpexp.status"] == metrics["status"] == "completed"
        assert run.info.status == "FINISHED"
        assert run.info.run_name == "/".join(job.resolve().parts[-4:])  # multirun/D/T/N
        for key in ("val/loss", "val/acc"):
            assert history(outputs, run, key) == [(h["step"], pytest.approx(h[key])) for h in metrics["history"]]
        steps = [s for s, _ in history(outputs, run, "train/loss")]
        assert steps == list(range(2, metrics["steps"] + 1, 2))


def _csv_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    points: dict[str, list[tuple[int, float]]] = {}
    for step, _, name, value in read_rows(run_dir / "metrics.csv"):
        points.setdefault(name, []).append((step, value))
    return points


def _mlflow_points(server: Path, run) -> dict[str, list[tuple[int, float]]]:
    c = client(server, "server.db")
    return {key: sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("procs", [1, 2])
def test_a_tracking_server_killed_mid_run_costs_one_warning_not_the_run(workdir, procs):
    server = workdir / "server"
    server.mkdir()
    with mlflow_server(server) as (url, proc):
        stamp = workdir / "killed_at"
        run_dir = workdir / "outputs" / "run"
        args = [*SMALL, "data.batch_size=8", "trainer.max_epochs=4", "trainer.log_every_n_steps=1",
                f"trainer.procs={procs}", "logger=[csv,mlflow]", f"logger.mlflow.tracking_uri={url}",
                "logger.mlflow.flush_every_s=0", "logger.mlflow.flush_timeout_s=3",
                "+callbacks.outage._target_=outage.KillServer", f"+callbacks.outage.pgid={proc.pid}",
                "+callbacks.outage.step=6", f"+callbacks.outage.stamp={stamp}",
                f"+callbacks.outage.url={url}", f"hydra.run.dir={run_dir}"]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}
        res = finish(start_cli(args, workdir, env), 300)
        ended = time.time()
    assert res.returncode == 0, res.output
    assert not res.leftovers
    # After the kill: the rest of the training (a second or two), the 3 s the end waits for
    # the tracker, and the processes' exit; without the writer this was minutes of retries.
    assert ended - float(stamp.read_text()) < 3 + 20
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed"
    (lost,) = metrics["lost_points"]["mlflow"]["steps"]
    assert 1 < lost[0] <= 7 and lost[1] == metrics["steps"]
    warnings = [line for line in res.output.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, warnings
    assert f"logger.mlflow lost points from step {lost[0]} on" in warnings[0]
    # The CSV logger kept every point; the server's store has every point before the lost
    # range, once, and none in it.
    csv = _csv_points(run_dir)
    assert [s for s, _ in csv["train/loss"]] == list(range(1, metrics["steps"] + 1))
    (run,) = runs_by_dir(server, "server.db").values()
    stored = _mlflow_points(server, run)
    for key, points in stored.items():
        assert points == [(s, pytest.approx(v)) for s, v in csv[key] if s < lost[0]], key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_and_resume_continue_one_mlflow_run_with_every_point_once(workdir):
    server = workdir / "server"
    server.mkdir()
    with mlflow_server(server) as (url, _):
        args = [*LONG, "logger=[csv,mlflow]", f"logger.mlflow.tracking_uri={url}",
                "logger.mlflow.flush_every_s=0"]
        run_dir, res, took = interrupt(workdir, args, signal.SIGTERM)
        ckpt = check_interrupted(run_dir, res, took, "SIGTERM")
        (run,) = runs_by_dir(server, "server.db").values()
        assert run.info.status == "KILLED" and run.data.tags["ddpexp.status"] == "interrupted"
        # A checkpoint written before the tracker had opened holds no run id (the resume
        # then finds the run by its run dir tag).
        assert ckpt["loggers"]["mlflow"].get("run_id", run.info.run_id) == run.info.run_id
        assert (ckpt["logger_queues"]["mlflow"]["acked_step"] or 0) <= ckpt["step"]
        run_cli([*args, f"trainer.max_epochs={ckpt['epoch'] + 2}", f"resume={run_dir}"], workdir)
    (again,) = runs_by_dir(server, "server.db").values()
    metrics = read_metrics(run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags["ddpexp.status"] == metrics["status"] == "completed"
    assert "lost_points" not in metrics
    # Step by step, MLflow holds what the CSV logger holds: every point once, none skipped
    # (an exact resume computes the same values again, so either session's value is right).
    csv = _csv_points(run_dir)
    stored = _mlflow_points(server, again)
    assert sorted(stored) == sorted(csv)
    for key, points in stored.items():
        assert points == [(s, pytest.approx(v)) for s, v in csv[key]], key
    # train/lr at the cadence of the other train scalars (trainer.log_every_n_steps).
    assert [s for s, _ in stored["train/lr"]] == [s for s, _ in stored["train/loss"]]
    assert stored["train/lr"][-1][0] > ckpt["step"]


def _mlflow_client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri="sqlite:///" + str((root / "mlflow.db").resolve()))


# ------------------------------------------------------------------ concurrency
def _write_concurrently(root: str, job: int, barrier) -> None:
    """A sweep job: its own MLflow run in the shared database, many small batches."""
    name = f"multirun/2026-12-01/10-20-00/{job}"
    run = RunInfo(Path(root) / name, name, {"job": job, "trainer": {"max_epochs": 3}},
                  {"job": job}, False, 0)
    run.run_dir.mkdir(parents=True)
    logger = MLflowLogger()
    barrier.wait(60)
    logger.open(run)
    logger.log_hparams(run.hparams)
    for s in range(1, 201):
        logger.log_metrics({"train/loss": job + 1 / s, "lr": 0.01 * s}, step=s, epoch=0)
        if s % 10 == 0:  # as the writer thread would, 20 points at a time
            logger.flush()
    logger.finalize("completed")
    (run.run_dir / "run_id").write_text(logger.run_id)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_four_jobs_write_one_sqlite_store_at_once(tmp_path):
    root = tmp_path / "outputs"
    node = {"_target_": "ddpexp.loggers.MLflowLogger", "tracking_uri": None}
    prepare_loggers({"mlflow": node}, root)
    assert (root / "mlflow.db").is_file()
    # Four processes of their own, forked from one that imported MLflow once (spawn made each
    # import it: seconds apiece).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["mlflow.tracking", "ddpexp.loggers.mlflow", __name__])
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_write_concurrently, args=(str(root), job, barrier))
             for job in range(4)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not any(p.is_alive() for p in procs)

    client = _mlflow_client(root)
    for job in range(4):
        run_id = (root / f"multirun/2026-12-01/10-20-00/{job}/run_id").read_text()
        stored = client.get_run(run_id)
        assert stored.info.status == "FINISHED"
        assert stored.data.params == {"job": str(job), "trainer.max_epochs": "3"}
        for key in ("train/loss", "lr"):
            history = client.get_metric_history(run_id, key)
            assert sorted(m.step for m in history) == list(range(1, 201)), (job, key)
    experiment = client.get_experiment_by_name("ddpexp")
    assert len(client.search_runs([experiment.experiment_id])) == 4
