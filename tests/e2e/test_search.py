"""The asynchronous Optuna search (``hydra/sweeper=optuna_async``): its search-space grammar,
sampler, direction and pruning reporter in-process on real optuna studies, and whole searches
through the CLI (every trial a real job process)."""

from __future__ import annotations

import re
import signal
import time
from datetime import datetime
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import finish, journal_study, read_metrics, run_cli, start_cli, summary_by_job
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from ddpexp.callbacks import pruning as trial_side
from ddpexp.errors import ConfigError
from ddpexp.runtime import trial as pruning
from ddpexp.sweep import search as _search
from ddpexp.sweep import space as _space

QUICK = ["hydra/sweeper=optuna_async", "trainer.log_every_n_steps=100000", "trainer.test=false"]


# ------------------------------------------------------------------------------ in-process
def test_discovery_and_config_registration() -> None:
    """Hydra finds the sweeper through the hydra_plugins namespace package, and its config is
    in the ConfigStore as hydra/sweeper=optuna_async; optuna is not imported by either."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from hydra.core.plugins import Plugins\n"
            "from hydra.plugins.sweeper import Sweeper\n"
            "from hydra.core.config_store import ConfigStore\n"
            "names = [c.__name__ for c in Plugins.instance().discover(Sweeper)]\n"
            "assert 'OptunaAsyncSweeper' in names, names\n"
            "assert 'optuna_async.yaml' in ConfigStore.instance().list('hydra/sweeper')\n"
            "assert 'optuna' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_search_space_grammar() -> None:
    fixed, space = _space.parse(
        ["optimizer.lr=tag(log,interval(1e-4,1e-1))", "data.batch_size=choice(32,64,128)",
         "trainer.max_epochs=range(1,4)", "model=mlp,convnet", "seed=3", "x=int(interval(2,9))"],
        {"optimizer.lr": "interval(0.5,0.6)", "trainer.procs": "1"})
    assert fixed == ["trainer.procs=1", "seed=3"]
    assert space == {
        "optimizer.lr": FloatDistribution(1e-4, 1e-1, log=True),  # the command line wins
        "data.batch_size": CategoricalDistribution([32, 64, 128]),
        "trainer.max_epochs": IntDistribution(1, 3),  # Hydra's range: stop excluded
        "model": CategoricalDistribution(["mlp", "convnet"]),
        "x": IntDistribution(2, 9),
    }
    grid_space = {k: v for k, v in space.items() if k not in ("optimizer.lr", "x")}
    assert _space.grid(grid_space) == {"data.batch_size": [32, 64, 128],
                                       "trainer.max_epochs": [1, 2, 3],
                                       "model": ["mlp", "convnet"]}
    with pytest.raises(ConfigError, match="grid cannot enumerate the interval of optimizer.lr"):
        _space.grid(space)
    with pytest.raises(ConfigError, match="needs a low end > 0"):
        _space.parse(["optimizer.lr=tag(log,interval(0,1))"], {})
    assert _space.as_overrides({"optimizer.lr": 1e-05, "model": "mlp", "data.batch_size": 64}) == \
        ["optimizer.lr=1e-05", "model=mlp", "data.batch_size=64"]


def test_config_reference_lists_every_sweeper_key() -> None:
    from dataclasses import fields

    from hydra_plugins.ddpexp_optuna_sweeper.config import (
        OptunaAsyncSweeperConf,
        PrunerConf,
        SamplerConf,
    )

    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    keys = [f"hydra.sweeper.{f.name}" for f in fields(OptunaAsyncSweeperConf)
            if f.name not in ("_target_", "sampler", "pruner")]
    keys += [f"hydra.sweeper.sampler.{f.name}" for f in fields(SamplerConf)]
    keys += [f"hydra.sweeper.pruner.{f.name}" for f in fields(PrunerConf)]
    assert [k for k in keys if f"`{k}`" not in doc] == []


class _Sweeper:
    def __init__(self, direction=None, monitor_mode=None, task="ddpexp.task.Classification",
                 monitor=None):
        from omegaconf import OmegaConf

        self.direction = direction
        self.config = OmegaConf.create({"trainer": {"monitor": monitor, "monitor_mode": monitor_mode},
                                        "task": {"_target_": task}})


def test_direction_follows_the_monitored_metric_unless_given() -> None:
    def direction(sweeper: _Sweeper) -> str:
        return _search._direction(sweeper, sweeper.config)

    assert direction(_Sweeper()) == "maximize"  # the classification task's val/acc
    assert direction(_Sweeper(task="ddpexp.task.Regression")) == "minimize"  # val/mse
    assert direction(_Sweeper(monitor_mode="min")) == "minimize"
    assert direction(_Sweeper(direction="maximize", monitor_mode="min")) == "maximize"
    # A monitor of the user's own: the mode its run resolves (loss-like names are minimised).
    assert direction(_Sweeper(monitor="val/loss")) == "minimize"
    with pytest.raises(ConfigError, match="direction=up is not one of maximize, minimize"):
        direction(_Sweeper(direction="up"))


@pytest.mark.parametrize("name", ["tpe", "random", "grid"])
def test_the_same_seed_asks_the_same_first_trials(name: str) -> None:
    _, space = _space.parse(["optimizer.lr=choice(0.01,0.02,0.05,0.1,0.2)",
                             "data.batch_size=choice(16,32,64,128)"], {})

    def first(seed: int) -> list[dict]:
        study = optuna.create_study(sampler=_search._sampler({"name": name, "seed": seed}, space))
        return [study.ask(space).params for _ in range(4)]

    assert first(7) == first(7)
    assert first(7) != first(8)
    with pytest.raises(ConfigError, match="sampler.name=cmaes is not one of tpe, random, grid"):
        _search._sampler({"name": "cmaes"}, space)


def test_reporter_reports_to_its_trial_and_the_median_pruner_answers(tmp_path: Path,
                                                                     monkeypatch) -> None:
    monkeypatch.delenv(pruning.ENV, raising=False)
    assert trial_side.from_env() is None and not trial_side.in_trial()
    study = journal_study(tmp_path)
    for good in (0.9, 0.8):  # two completed trials with a value at every epoch
        trial = study.ask()
        for epoch in range(3):
            trial.report(good, epoch)
        study.tell(trial, good)
    spec = {"name": "median", "n_startup_trials": 2, "n_warmup_steps": 1}
    for value, pruned in ((0.88, [False, False]), (0.1, [False, True])):
        trial = study.ask()
        env = pruning.trial_env(str(tmp_path / _search.JOURNAL), "ddpexp", trial._trial_id, spec)
        monkeypatch.setenv(pruning.ENV, env[pruning.ENV])
        reporter = trial_side.from_env()
        assert reporter is not None and trial_side.in_trial()
        # Epoch 0 is a warm-up step: never pruned; at epoch 1 the bad trial is.
        assert [reporter.should_prune(e, value) for e in range(2)] == pruned
        assert study.trials[trial.number].intermediate_values == {0: value, 1: value}
    with pytest.raises(ConfigError, match="pruner.name=early is not one of none, median"):
        pruning.build_pruner({"name": "early"})


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_search_keeps_both_slots_busy_prunes_and_survives_a_failed_trial(workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    study = journal_study(sweep_dir)
    # Four trials queued first, in this order (optuna's enqueue_trial, asked before any
    # sampled one): two good ones, one that fails in torch (a negative learning rate), one
    # that cannot learn (lr=0) and must be pruned once a good one has completed; that one
    # runs 2 DDP workers, which must both stop.
    for lr, epochs, procs in ((0.1, 3, 1), (0.1, 2, 1), (-1.0, 3, 1), (0.0, 3, 2)):
        study.enqueue_trial({"optimizer.lr": lr, "trainer.max_epochs": epochs,
                             "trainer.procs": procs})
    res = run_cli(["-m", *QUICK, "resume=auto", f"hydra.sweep.dir={sweep_dir}",
                   "hydra.sweeper.n_trials=6", "hydra.launcher.max_parallel=2",
                   "hydra.sweeper.sampler.name=random", "hydra.sweeper.sampler.seed=0",
                   "hydra.sweeper.pruner.name=median", "hydra.sweeper.pruner.n_startup_trials=1",
                   "optimizer.lr=choice(0.1,0.05,0.0,-1.0)", "trainer.max_epochs=range(1,4)",
                   "trainer.procs=choice(1,2)"],
                  workdir, timeout=400)
    trials = journal_study(sweep_dir).trials
    assert len(trials) == 6 and all(t.state.is_finished() for t in trials)
    assert [t.state for t in trials[:4]] == [TrialState.COMPLETE, TrialState.COMPLETE,
                                             TrialState.FAIL, TrialState.PRUNED]
    # Both slots were busy until the last trial started (trials of 1-3 epochs): the job
    # seconds inside [first start, last start] over 2 x that window, from the launcher's log
    # of starts and ends. Over the whole search the tail, where the last trial runs alone
    # while nothing is left to ask, counts too.
    starts, ends = _logged(res.output, JOB_START), _logged(res.output, JOB_END)
    assert sorted(starts) == sorted(ends) == list(range(6))
    first, last_start, end = min(starts.values()), max(starts.values()), max(ends.values())

    def busy(until: float) -> float:
        return sum(max(0.0, min(ends[n], until) - starts[n]) for n in starts)

    assert busy(last_start) / (2 * (last_start - first)) >= 0.85
    assert busy(end) / (2 * (end - first)) >= 0.75
    # A freed slot got its next trial without a round-trip to the study: that trial was
    # asked while the others ran, and its start is logged before the ended trial is told.
    # The first four trials to end each freed a slot for one of trials 2-5.
    lines = res.output.splitlines()
    for n in sorted(ends, key=ends.__getitem__)[:4]:
        ended = next(i for i, line in enumerate(lines) if f"#{n} ended (" in line)
        told = next(i for i, line in enumerate(lines) if f"trial {n}: " in line)
        started = [i for i, line in enumerate(lines) if JOB_START.search(line) and i > ended]
        assert started and started[0] < told, lines[ended:told + 1]

    pruned = read_metrics(sweep_dir / "3")
    assert pruned["status"] == "pruned" and pruned["epochs"] < 3 and pruned["world_size"] == 2
    assert (sweep_dir / "3" / "checkpoints" / "last.pt").is_file()
    assert read_metrics(sweep_dir / "0")["epochs"] == 3
    rows = summary_by_job(sweep_dir)
    assert len(rows) == 6
    assert (rows["0"]["status"], rows["2"]["status"], rows["3"]["status"]) == \
        ("completed", "failed", "pruned")
    assert "optimizer.lr=-1.0 must be >= 0" in rows["2"]["error"]
    assert "optimizer.lr=-1.0" in rows["2"]["overrides"]

    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value)  # maximize: trainer.monitor_mode=max
    assert results["direction"] == "maximize" and results["best_trial"] == best.number
    assert results["best_value"] == pytest.approx(read_metrics(sweep_dir / str(best.number))
                                                  ["best"]["val/acc"])
    assert results["best_params"] == best.params
    assert f"trial {best.number}, val/acc = {best.value:.4f}" in res.output
    assert "trial 2: failed" in res.output and "trial 3: pruned" in res.output


@pytest.mark.slow
def test_fail_fast_stops_the_search_at_the_first_failed_trial(workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    journal_study(sweep_dir).enqueue_trial({"optimizer.lr": -1.0})
    res = run_cli(["-m", *QUICK, "resume=auto", f"hydra.sweep.dir={sweep_dir}",
                   "hydra.sweeper.n_trials=3", "hydra.launcher.fail_fast=true",
                   "hydra.launcher.max_parallel=1",
                   "optimizer.lr=choice(0.1,-1.0)", "trainer.max_epochs=1"],
                  workdir, timeout=200, expect_ok=False)
    assert res.returncode != 0
    assert "stopped at the first failed trial" in res.stderr
    assert [t.state for t in journal_study(sweep_dir).trials] == [TrialState.FAIL]
    assert not (sweep_dir / "1").exists()


@pytest.mark.slow
def test_interrupted_search_resumes_to_exactly_n_trials(workdir: Path) -> None:
    sweep_dir = workdir / "sweep"
    study = journal_study(sweep_dir)
    # Trial 0 ends after one short epoch; trial 1 (small batches, more epochs) runs long
    # enough to be cut off after its first checkpoint.
    study.enqueue_trial({"trainer.max_epochs": 1, "data.batch_size": 128})
    study.enqueue_trial({"trainer.max_epochs": 6, "data.batch_size": 8})
    args = ["-m", *QUICK, "resume=auto", f"hydra.sweep.dir={sweep_dir}",
            "hydra.sweeper.n_trials=3", "hydra.launcher.max_parallel=2",
            "hydra.sweeper.sampler.name=random", "hydra.sweeper.sampler.seed=1",
            "trainer.max_epochs=choice(1,6)", "data.batch_size=choice(8,128)"]
    proc = start_cli(args, workdir)
    deadline = time.time() + 240
    # Trial 0 told complete (its metrics.json says so a moment before its process ends and the
    # search tells the study) and trial 1 past its first checkpoint.
    while not ((sweep_dir / "1" / "checkpoints" / "last.pt").exists()
               and _status(sweep_dir / "0") == "completed"
               and journal_study(sweep_dir).trials[0].state == TrialState.COMPLETE):
        assert proc.poll() is None and time.time() < deadline, "trial 1 never saved a checkpoint"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    res = finish(proc, timeout=120)
    assert not res.leftovers
    assert res.returncode != 0
    assert f"resume=auto hydra.sweep.dir={sweep_dir}" in res.output
    trials = journal_study(sweep_dir).trials
    assert [t.state for t in trials[:2]] == [TrialState.COMPLETE, TrialState.RUNNING]
    assert read_metrics(sweep_dir / "1")["status"] == "interrupted"
    before = {p: p.stat().st_mtime_ns for p in (sweep_dir / "0").rglob("*") if p.is_file()}

    # The same command again: trial 1 continues from its last.pt; the study ends at 3 trials.
    run_cli(args, workdir, timeout=300)
    trials = journal_study(sweep_dir).trials
    assert len(trials) == 3 and all(t.state == TrialState.COMPLETE for t in trials)
    assert {p: p.stat().st_mtime_ns for p in (sweep_dir / "0").rglob("*") if p.is_file()} == before
    assert "resumed from" in (sweep_dir / "1" / "ddpexp.log").read_text()
    assert read_metrics(sweep_dir / "1")["epochs"] == 6
    assert len(summary_by_job(sweep_dir)) == 3


JOB_START = re.compile(r"^\[([^\]]+)\]\[HYDRA\]\s+#(\d+) : ")
JOB_END = re.compile(r"^\[([^\]]+)\]\[HYDRA\]\s+#(\d+) ended ")


def _logged(output: str, pattern: re.Pattern) -> dict[int, float]:
    """Job number -> when the launcher logged ``pattern`` for it (its start or its end)."""
    found = {}
    for line in output.splitlines():
        m = pattern.search(line)
        if m:
            when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found[int(m.group(2))] = when
    return found


def _status(run_dir: Path):
    try:
        return read_metrics(run_dir).get("status")
    except (OSError, ValueError):
        return None
