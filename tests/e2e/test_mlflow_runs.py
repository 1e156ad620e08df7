"""logger=mlflow in real runs: a sweep whose jobs write one SQLite store side by side, each
job one MLflow run equal to its metrics.json, and a run stopped by SIGTERM and resumed that
stays one MLflow run with every step once; four processes writing one SQLite store at once."""

from __future__ import annotations

import multiprocessing
import signal
import time
from pathlib import Path

import pytest
import yaml

from ddpexp.loggers import MLflowLogger, RunInfo, prepare_loggers
from helpers import read_metrics, run_cli, run_dirs
from test_checkpoint_signals import LONG, check_interrupted, interrupt

pytest.importorskip("mlflow")

SMALL = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=64",
    "data.val_samples=32", "model=mlp", "model.hidden=[8]", "trainer.max_epochs=2",
    "trainer.log_every_n_steps=2", "trainer.test=false",
]


def client(outputs: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{(outputs / 'mlflow.db').resolve()}")


def runs_by_dir(outputs: Path) -> dict[str, object]:
    c = client(outputs)
    (experiment,) = [e for e in c.search_experiments() if e.name == "ddpexp"]
    runs = c.search_runs([experiment.experiment_id], max_results=100)
    return {r.data.tags["ddpexp.run_dir"]: r for r in runs}


def history(outputs: Path, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client(outputs).get_metric_history(run.info.run_id, key))


@pytest.mark.slow
def test_a_sweep_of_four_jobs_two_at_once_is_four_runs_in_one_store(workdir):
    run_cli(["-m", *SMALL, "optimizer.lr=0.05,0.1", "data.batch_size=16,32",
             "hydra.launcher.max_parallel=2", "logger=[tensorboard,mlflow]"], workdir, timeout=240)
    outputs = workdir / "outputs"
    jobs = [d for d in run_dirs(outputs) if (d / "metrics.json").is_file()]
    runs = runs_by_dir(outputs)
    assert len(jobs) == 4 and sorted(runs) == sorted(str(d.resolve()) for d in jobs)
    for job in jobs:
        run, metrics = runs[str(job.resolve())], read_metrics(job)
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        assert run.data.params["optimizer.lr"] == str(config["optimizer"]["lr"])
        assert run.data.params["data.batch_size"] == str(config["data"]["batch_size"])
        assert run.data.tags["ddpexp.status"] == metrics["status"] == "completed"
        assert run.info.status == "FINISHED"
        assert run.info.run_name == "/".join(job.resolve().parts[-4:])  # multirun/D/T/N
        for key in ("val/loss", "val/acc"):
            assert history(outputs, run, key) == [(h["step"], pytest.approx(h[key])) for h in metrics["history"]]
        steps = [s for s, _ in history(outputs, run, "train/loss")]
        assert steps == list(range(2, metrics["steps"] + 1, 2))


@pytest.mark.slow
def test_sigterm_and_resume_continue_one_mlflow_run(workdir):
    args = [*LONG, "logger=[tensorboard,mlflow]"]
    run_dir, res, took = interrupt(workdir, args, signal.SIGTERM)
    ckpt = check_interrupted(run_dir, res, took, "SIGTERM")
    outputs = workdir / "outputs"
    (run,) = runs_by_dir(outputs).values()
    assert run.info.status == "KILLED" and run.data.tags["ddpexp.status"] == "interrupted"
    assert ckpt["loggers"]["mlflow"]["run_id"] == run.info.run_id
    run_cli([*args, f"trainer.max_epochs={ckpt['epoch'] + 2}", f"resume={run_dir}"], workdir)
    (again,) = runs_by_dir(outputs).values()
    metrics = read_metrics(run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags["ddpexp.status"] == metrics["status"] == "completed"
    for key in ("train/loss", "train/lr", "val/loss"):
        steps = [s for s, _ in history(outputs, again, key)]
        assert steps == sorted(set(steps)), f"{key}: a step twice"
    assert [s for s, _ in history(outputs, again, "train/lr")] == list(range(1, metrics["steps"] + 1))
    assert history(outputs, again, "val/loss") == [(h["step"], pytest.approx(h["val/loss"])) for h in metrics["history"]]


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
    logger = MLflowLogger(flush_every_points=20, flush_every_s=0)
    barrier.wait(60)
    logger.open(run)
    logger.log_hparams(run.hparams)
    for s in range(1, 201):
        logger.log_metrics({"train/loss": job + 1 / s, "lr": 0.01 * s}, step=s, epoch=0)
    logger.finalize("completed")
    (run.run_dir / "run_id").write_text(logger.run_id)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_four_jobs_write_one_sqlite_store_at_once(tmp_path):
    root = tmp_path / "outputs"
    node = {"_target_": "ddpexp.loggers.MLflowLogger", "tracking_uri": None}
    prepare_loggers({"mlflow": node}, root)
    assert (root / "mlflow.db").is_file()
    ctx = multiprocessing.get_context("spawn")
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
