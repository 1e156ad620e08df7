"""The sweep driver on a backend other than the local one: ``hydra/launcher=subprocess`` (a
launcher of the tests, tests/plugins) runs every job as a plain ``python -m ddpexp``, and the
``optuna_async`` search, its study, results and summary work on it as on the ddp launcher."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import read_metrics, run_cli
from optuna.trial import TrialState

from ddpexp.runtime import trial as pruning
from ddpexp.sweep import search as _search

PLUGINS = str(Path(__file__).parents[1] / "plugins")
QUICK = ["hydra/sweeper=optuna_async", "trainer.log_every_n_steps=100000", "trainer.test=false"]


def plugin_env() -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_a_search_runs_on_another_backend(workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    res = run_cli(["-m", *QUICK, "hydra/launcher=subprocess", f"hydra.sweep.dir={sweep_dir}",
                   "hydra.sweeper.n_trials=3", "hydra.launcher.max_parallel=2",
                   "hydra.sweeper.sampler.name=random", "hydra.sweeper.sampler.seed=0",
                   "optimizer.lr=choice(0.05,0.1)", "trainer.max_epochs=1"],
                  workdir, env=plugin_env(), timeout=400)
    assert "each job a python -m ddpexp of its own, up to 2 at once" in res.output
    study = optuna.load_study(study_name="ddpexp",
                              storage=pruning.journal_storage(str(sweep_dir / _search.JOURNAL)))
    trials = study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    for t in trials:
        job_dir = sweep_dir / str(t.number)
        metrics = read_metrics(job_dir)
        assert metrics["status"] == "completed" and metrics["epochs"] == 1
        assert t.value == pytest.approx(metrics["best"]["val/acc"])
        # A plain run in the job's dir, not a job process of the local backend.
        hydra_yaml = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())
        assert hydra_yaml["hydra"]["mode"] == "RUN"
        assert "forked from the fork server" not in (job_dir / "ddpexp.log").read_text()

    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_trial"] == study.best_trial.number
    assert results["best_value"] == pytest.approx(study.best_value)
    assert results["trials"]["complete"] == 3
    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["0", "1", "2"]
    assert {r["status"] for r in rows.values()} == {"completed"}
    assert all("optimizer.lr=" in r["overrides"] for r in rows.values())


def test_a_launcher_without_a_backend_is_refused(workdir: Path) -> None:
    res = run_cli(["-m", "hydra/sweeper=optuna_async", "hydra/launcher=basic",
                   "optimizer.lr=choice(0.05,0.1)"], workdir, timeout=120, expect_ok=False)
    assert res.returncode != 0
    assert ("hydra/sweeper=optuna_async starts its trials on ddpexp's launcher: use "
            "hydra/launcher=ddp (this sweep has BasicLauncher)") in res.stderr
    assert "Traceback" not in res.stderr
