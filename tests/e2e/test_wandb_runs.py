"""logger=wandb in real runs, read back offline with W&B's own reader (``wandb leet inspect
--json``): a 2-worker run is one W&B run; a run SIGKILLed mid-run and resumed continues the
same W&B run with every step once; a sweep's four jobs are four runs in one group; a W&B service
killed mid-run costs one warning and the steps it lost, never the run; online mode without
credentials is refused before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_metrics, run_cli, run_dirs
from test_checkpoint_signals import HUGE, LONG

from ddpexp.loggers.csv import read_rows

pytest.importorskip("wandb")

SMALL = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=64",
    "data.val_samples=32", "data.batch_size=8", "model=mlp", "model.hidden=[8]",
    "trainer.max_epochs=2", "trainer.log_every_n_steps=2", "trainer.test=false",
    "trainer.progress_bar=false",
]
PLUGINS = str(Path(__file__).parents[1] / "plugins")
WANDB = str(Path(sys.executable).with_name("wandb"))


def sessions(run_dir: Path) -> list[Path]:
    """The offline W&B session dirs of a run, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def inspect(session: Path, summary: bool = False) -> list[dict] | dict:
    """What W&B's own reader finds in an offline session: its records, or its summary."""
    out = subprocess.run([WANDB, "leet", "inspect", "--json", *(["--summary"] if summary else []),
                          str(session)], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out) if summary else [json.loads(line) for line in out.splitlines()]


def points(session: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric point of a session's history, by key, against trainer/global_step."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in inspect(session):
        if record["type"] != "history":
            continue
        item = record["history"]["item"]
        for key, value in item.items():
            if not key.startswith("_") and key != "trainer/global_step":
                out.setdefault(key, []).append((item["trainer/global_step"], value))
    return out


def csv_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step, _, name, value in read_rows(run_dir / "metrics.csv"):
        out.setdefault(name, []).append((step, value))
    return out


@pytest.mark.slow
def test_two_workers_write_one_offline_run_with_the_config_and_every_validation(workdir):
    run_dir = workdir / "outputs" / "run"
    res = run_cli([*SMALL, "trainer.procs=2", "logger=[csv,wandb]", "optimizer.lr=0.07",
                   f"hydra.run.dir={run_dir}"], workdir, timeout=240)
    (session,) = sessions(run_dir)
    summary = inspect(session, summary=True)
    run_id = (run_dir / "wandb" / "ddpexp-run-id").read_text().strip()
    assert summary["run_id"] == run_id and session.name.endswith(f"-{run_id}")
    assert summary["state"] == "finished" and summary["project"] == "ddpexp"
    assert summary["config"]["optimizer"]["lr"] == 0.07
    metrics = read_metrics(run_dir)
    assert summary["summary"]["status"] == metrics["status"] == "completed"
    assert summary["summary"]["best/val/acc"] == pytest.approx(metrics["best"]["val/acc"])
    got = points(session)
    for key in ("val/loss", "val/acc"):
        assert got[key] == [(h["step"], pytest.approx(h[key])) for h in metrics["history"]]
    assert got == {k: [(s, pytest.approx(v)) for s, v in p] for k, p in csv_points(run_dir).items()}
    assert f"upload it with: wandb sync {run_dir / 'wandb'}" in res.output


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigkill_then_resume_continues_the_same_run_with_every_step_once(workdir):
    run_dir = workdir / "outputs" / "run"
    args = [*LONG, "trainer.ckpt_every_steps=5", "trainer.log_every_n_steps=1",
            "logger=[csv,wandb]", f"hydra.run.dir={run_dir}"]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}
    # Killed at step 8, once W&B holds step 7: steps 6 and 7 are past the checkpoint of step 5.
    res = run_cli([*args, HUGE, "+callbacks.killer._target_=wandb_outage.KillWhenStored",
                   "+callbacks.killer.step=8"], workdir, env=env, expect_ok=False, timeout=240)
    assert res.returncode == -signal.SIGKILL, res.output
    import torch

    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    # The resume keeps the run's overrides but for the killer, which it takes out.
    run_cli([*args, f"trainer.max_epochs={ckpt['epoch'] + 2}", "~callbacks.killer",
             f"resume={run_dir}"], workdir, timeout=240)
    first, second = sessions(run_dir)
    run_id = (run_dir / "wandb" / "ddpexp-run-id").read_text().strip()
    assert ckpt["loggers"]["wandb"]["run_id"] == run_id
    assert {inspect(s, summary=True)["run_id"] for s in (first, second)} == {run_id}
    # What docs/loggers.md has users read: latest-run, the newest session (the glob of
    # offline-run-* names two dirs here, which W&B's reader refuses).
    assert (run_dir / "wandb" / "latest-run").resolve() == second.resolve()
    assert "wandb leet inspect --summary --json <run dir>/wandb/latest-run" in (
        Path(__file__).parents[2] / "docs" / "loggers.md").read_text()
    # The first session holds points past the checkpoint; the second does not hold them again.
    before, after = points(first), points(second)
    assert ckpt["step"] == 5 and max(s for s, _ in before["train/loss"]) == 7
    assert min(s for s, _ in after["train/loss"]) > max(s for s, _ in before["train/loss"])
    both = {key: before.get(key, []) + after.get(key, []) for key in {*before, *after}}
    expected = csv_points(run_dir)
    assert sorted(both) == sorted(expected)
    for key, got in both.items():
        assert [s for s, _ in got] == [s for s, _ in expected[key]], key
        if "time" not in key and "per_s" not in key:  # an exact resume: the same values again
            assert got == [(s, pytest.approx(v)) for s, v in expected[key]], key
    assert read_metrics(run_dir)["status"] == "completed"


@pytest.mark.slow
def test_a_sweep_of_four_jobs_is_four_runs_in_one_group(workdir):
    run_cli(["-m", *SMALL, "trainer.max_epochs=1", "optimizer.lr=0.05,0.1", "seed=1,2",
             "hydra.launcher.max_parallel=2", "logger=wandb"], workdir, timeout=300)
    jobs = run_dirs(workdir / "outputs")
    assert len(jobs) == 4
    sweep = "/".join(jobs[0].resolve().parts[-4:-1])  # multirun/D/T
    ids = set()
    for job in jobs:
        (session,) = sessions(job)
        run = next(r["run"] for r in inspect(session) if r["type"] == "run")
        assert run["run_group"] == sweep and run["job_type"] == "sweep-job"
        config = json.loads(json.dumps(run["config"]["update"]))
        assert f"optimizer.lr={config['optimizer']['lr']}" in run["tags"]
        assert inspect(session, summary=True)["summary"]["status"] == "completed"
        ids.add(run["run_id"])
    assert len(ids) == 4


@pytest.mark.slow
def test_a_killed_service_costs_one_warning_and_the_lost_steps_not_the_run(workdir):
    run_dir = workdir / "outputs" / "run"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}
    res = run_cli([*SMALL, "trainer.max_epochs=3", "trainer.log_every_n_steps=1",
                   "logger=[csv,wandb]", "+callbacks.outage._target_=wandb_outage.KillService",
                   "+callbacks.outage.step=5", f"hydra.run.dir={run_dir}"], workdir, env=env,
                  timeout=240)
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed"
    (lost,) = metrics["lost_points"]["wandb"]["steps"]
    assert lost[0] in (5, 6) and lost[1] == metrics["steps"]  # all up to step 4 stored
    warnings = [line for line in res.output.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and f"logger.wandb lost points from step {lost[0]} on" in warnings[0], \
        warnings
    assert "Traceback" not in res.output
    assert [s for s, _ in csv_points(run_dir)["train/loss"]] == list(range(1, metrics["steps"] + 1))


def test_online_without_credentials_is_refused_before_anything_is_written(workdir):
    env = {"WANDB_API_KEY": "", "HOME": str(workdir), "NETRC": str(workdir / "no-netrc")}
    res = run_cli([*SMALL, "logger=wandb", "logger.wandb.mode=online"], workdir, env=env,
                  expect_ok=False, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.output
    assert "logger.wandb.mode=online: no W&B credentials here" in res.stderr
    assert "wandb login" in res.stderr
    assert not (workdir / "outputs").exists() or not run_dirs(workdir / "outputs")


@pytest.mark.timeout(300)
def test_a_job_killed_with_its_wandb_service_keeps_what_it_logged_up_to_one_flush_before(workdir):
    # A kill of the job and of W&B's service at once (a cgroup's): the offline file holds
    # what was logged up to logger.wandb.flush_every_s before the kill, not W&B's 15 s (in
    # a run this short: nothing but its 7-byte header).
    from ddpexp.loggers.wandb import stored_steps

    run_dir = workdir / "outputs" / "run"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}
    res = run_cli([*LONG, HUGE, "trainer.log_every_n_steps=1", "logger=wandb",
                   "logger.wandb.flush_every_s=0.5", "+callbacks.kill._target_=wandb_outage.KillEverything",
                   "+callbacks.kill.step=8", "+callbacks.kill.wait_s=2", f"hydra.run.dir={run_dir}"],
                  workdir, env=env, expect_ok=False, timeout=240)
    assert res.returncode == -signal.SIGKILL, res.output
    run_id = (run_dir / "wandb" / "ddpexp-run-id").read_text().strip()
    assert stored_steps(run_dir / "wandb", run_id).get("train/loss", -1) >= 7, res.output
