"""The ``optuna_async`` search, which its Hydra plugin (``hydra_plugins.ddpexp_optuna_sweeper``)
hands over to inside ``sweep()``.

An optuna study in ``<sweep dir>/optuna.journal`` (optuna's journal file storage: several
processes may read and write it, no database server) is driven by ask/tell on the
sweep's :class:`~ddpexp.sweep.driver.Driver`, over the backend the launcher offers
(:mod:`ddpexp.sweep.backend`; the ddp launcher's runs jobs on this machine): whenever there
is room for a job its trial's job is started, and whenever a job ends its trial is told. So
the machine stays full (``max_parallel: null``), or ``max_parallel`` trials run, at every
moment until ``n_trials`` have been asked. The next trial is asked and its job composed while
the running ones run, so a freed slot gets its job at once (a fork, not a round-trip to the
study and the sampler); the ended trial is told after that start (with
``hydra.launcher.fail_fast``, the next trial is asked once its slot is free). A trial's ``datetime_start``
in the study is therefore when it was asked, up to one trial's length before its job started;
the launcher's log has each job's start. Trial N runs in the sweep's job dir N. Each job process gets the trial's identity in its environment
(:mod:`ddpexp.callbacks.pruning`), so its rank 0 reports every epoch and the pruner can stop it.

A job that completed gives the trial its best monitored value; a run that the pruner stopped
(``metrics.json`` status ``pruned``) is told PRUNED; a failed or diverged one FAIL, and the
search goes on (``hydra.launcher.fail_fast`` stops it). A trial cut off by Ctrl-C/SIGTERM
stays RUNNING in the study: ``resume=auto`` with the same sweep dir runs it again in its dir,
where ddpexp continues its ``last.pt``, and asks only what ``n_trials`` still lacks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf

from ddpexp.config.commands import continue_sweep
from ddpexp.config.monitor import resolve_monitor
from ddpexp.config.schema import MonitorMode
from ddpexp.errors import ConfigError
from ddpexp.record import read_metrics_or_empty
from ddpexp.runtime import trial as pruning
from ddpexp.sweep import driver as sweep_driver
from ddpexp.sweep import space as sweep_space
from ddpexp.sweep.backend import Backend, Job, JobFailed, JobSkipped, SweepInterrupted
from ddpexp.sweep.settings import Sweep, SweepLauncher
from ddpexp.sweep.summary import job_error, summarize

log = logging.getLogger("hydra_plugins.ddpexp_optuna_sweeper")

JOURNAL = "optuna.journal"
RESULTS = "optimization_results.yaml"
SAMPLERS = ("tpe", "random", "grid")
DIRECTIONS = ("maximize", "minimize")


class SearchStopped(JobFailed):
    """The search ended early: a trial failed under ``fail_fast``, or no trial completed."""


@dataclass(frozen=True)
class SearchSettings:
    """``hydra.sweeper.*`` of ``optuna_async`` (the plugin's config dataclass has the docs)."""

    n_trials: int = 20
    direction: str | None = None
    study_name: str = "ddpexp"
    sampler: dict = field(default_factory=dict)
    pruner: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)


def run(settings: SearchSettings, config: DictConfig, launcher: Launcher,
        arguments: list[str]) -> dict | None:
    """Run the search with ``launcher``'s jobs (it must be one of ddpexp's); return the best
    trial's ``{"params", "value", "number"}`` (None when no trial completed)."""
    import optuna

    if not isinstance(launcher, SweepLauncher) or launcher.sweep is None:
        raise ConfigError("hydra/sweeper=optuna_async starts its trials on ddpexp's launcher: "
                          f"use hydra/launcher=ddp (this sweep has {type(launcher).__name__})")
    sweep = launcher.sweep
    backend = sweep.backend()
    fixed, space = sweep_space.parse(arguments, settings.params)
    if not space:
        raise ConfigError("hydra/sweeper=optuna_async needs a search space: e.g. "
                          "'optimizer.lr=tag(log,interval(1e-4,1e-1))' or "
                          "'data.batch_size=choice(32,64,128)' (or hydra.sweeper.params)")
    sweep_dir = sweep_driver.begin(sweep.hydra)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = _open_study(settings, config, sweep_dir, space)
    search = _Search(settings, sweep, study, fixed, space, sweep_dir)
    return search.run(backend)


def _monitored(config: Any) -> tuple:
    """``(trainer.monitor, trainer.monitor_mode)``, the task's own where they are null."""
    mode = OmegaConf.select(config, "trainer.monitor_mode", default=None)
    return resolve_monitor(str(OmegaConf.select(config, "task._target_")),
                           OmegaConf.select(config, "trainer.monitor", default=None),
                           None if mode is None else str(MonitorMode(mode)))


def _direction(settings: SearchSettings, config: Any) -> Literal["maximize", "minimize"]:
    """``hydra.sweeper.direction``, or what the monitored metric's mode implies."""
    direction = settings.direction
    if direction is None:
        return "maximize" if _monitored(config)[1] == "max" else "minimize"
    direction = str(direction).lower()
    if direction not in DIRECTIONS:
        raise ConfigError(f"hydra.sweeper.direction={direction} is not one of "
                          f"{', '.join(DIRECTIONS)} (or null: from trainer.monitor_mode)")
    return cast(Literal["maximize", "minimize"], direction)  # one of DIRECTIONS


def _sampler(spec: dict[str, Any], space: dict[str, Any]) -> Any:
    import optuna

    name = str(spec.get("name", "tpe")).lower()
    seed = spec.get("seed")
    if name == "tpe":
        # constant_liar: trials still running count as (pessimistic) results, so parallel
        # trials are not all asked near the same point.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(sweep_space.grid(space), seed=seed)
    raise ConfigError(f"hydra.sweeper.sampler.name={name} is not one of {', '.join(SAMPLERS)}")


def _open_study(settings: SearchSettings, config: Any, sweep_dir: Path, space: dict[str, Any]) -> Any:
    """The study in the sweep dir: created, or (``resume=auto``) loaded. An existing study
    without ``resume=auto`` is refused, so that a second search never mixes into it."""
    import optuna

    journal = sweep_dir / JOURNAL
    storage = pruning.journal_storage(str(journal))
    name = str(settings.study_name)
    direction = _direction(settings, config)
    exists = name in optuna.get_all_study_names(storage)
    resume = OmegaConf.select(config, "resume", default=None) == "auto"
    if exists and not resume:
        raise ConfigError(f"{journal} already holds the study {name!r}: add resume=auto to "
                          "continue it, or give another hydra.sweep.dir (or "
                          "hydra.sweeper.study_name)")
    study = optuna.create_study(study_name=name, storage=storage, direction=direction,
                                sampler=_sampler(settings.sampler, space),
                                pruner=pruning.build_pruner(settings.pruner), load_if_exists=True)
    if study.direction.name.lower() != direction:
        raise ConfigError(f"the study {name!r} in {journal} was started to "
                          f"{study.direction.name.lower()}, not to {direction}: resume it with "
                          f"hydra.sweeper.direction={study.direction.name.lower()}")
    return study


class _Search:
    """One invocation of the search: resume what was cut off, ask until ``n_trials``, tell."""

    def __init__(self, settings: SearchSettings, sweep: Sweep, study: Any, fixed: list[str],
                 space: dict[str, Any], sweep_dir: Path) -> None:
        self.settings, self.study, self.fixed, self.space = settings, study, fixed, space
        self.sweep = sweep
        self.fail_fast = sweep.settings.fail_fast
        self.sweep_dir = sweep_dir
        self.jobs: list[Job] = []
        self.failed = False
        self.monitor = _monitored(sweep.hydra.config)[0]
        self.cut_off: list[Any] = []  # trials RUNNING in the study when this search started
        self.to_ask = 0

    # ------------------------------------------------------------------ the loop
    def run(self, backend: Backend) -> dict | None:
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        self.cut_off = [t for t in trials if t.state == TrialState.RUNNING]
        done = sum(t.state.is_finished() for t in trials)
        n_trials = int(self.settings.n_trials)
        if str(self.settings.sampler.get("name", "tpe")).lower() == "grid":
            grid = sweep_space.grid(self.space)
            n_trials = min(n_trials, math.prod(len(v) for v in grid.values()))
        self.to_ask = max(0, n_trials - done - len(self.cut_off))
        driver = sweep_driver.Driver(self.sweep, backend)
        log.info("optuna_async: study %r in %s: %d trial(s) done before, %d to resume, %d to "
                 "ask, %s", self.study.study_name, self.sweep_dir / JOURNAL, done,
                 len(self.cut_off), self.to_ask, backend.describe())
        with driver:
            ready = self._ahead(driver, self._fill(driver, None))
            while driver.running:
                ended = driver.wait_any()
                if self.fail_fast and not driver.stopped and any(
                        j.ret is not None and j.ret.status != JobStatus.COMPLETED for j in ended):
                    self.failed = True  # before the freed slot is filled: nothing more starts
                # The freed slot first, with the trial asked while these ran; then the study.
                ready = self._fill(driver, ready)
                for job in ended:
                    self._tell(job, driver)
                ready = self._ahead(driver, self._fill(driver, ready))
                if ended:
                    summarize(self.sweep.hydra.outcomes, self.jobs, self.sweep_dir, final=False)
        waiting = ready
        if waiting is not None and not driver.stopped:
            why = "not run: an earlier trial failed and hydra.launcher.fail_fast=true"
            waiting.ret = JobReturn(overrides=waiting.overrides, cfg=waiting.config,
                                    status=JobStatus.FAILED, _return_value=JobSkipped(why))
            self._tell_state(waiting.idx, "fail", why)
        summarize(self.sweep.hydra.outcomes, self.jobs, self.sweep_dir)
        best = self._results()
        if driver.stopped:
            raise SweepInterrupted(
                f"the search was stopped by {driver.stopped}. To continue it, "
                f"{continue_sweep(self.sweep_dir)}", driver.stopped)
        if self.failed and self.fail_fast:
            raise SearchStopped("the search stopped at the first failed trial "
                                "(hydra.launcher.fail_fast=true); see the failures above")
        if best is None:
            raise SearchStopped(f"no trial of the study completed; see {self.sweep_dir}/summary.md "
                                "and the failures above")
        return best

    def _fill(self, driver: sweep_driver.Driver, waiting: Job | None) -> Job | None:
        """Start trials while a slot is free and trials remain, ``waiting`` (the one asked
        ahead) first; return the job that is left waiting for a slot or its GPUs, if any."""
        while self._going(driver) and driver.free:
            if waiting is None:
                waiting = self._runnable(driver)
                if waiting is None:
                    break
            if not driver.start(waiting):
                break
            waiting = None
        return waiting

    def _ahead(self, driver: sweep_driver.Driver, waiting: Job | None) -> Job | None:
        """The next trial asked and its job composed while the others run, unless one
        already waits: when a slot frees, starting it is all that is left to do. Not under
        ``fail_fast``, where a trial asked ahead of a failure would never run, yet stay in the
        study as failed."""
        if waiting is None and not self.fail_fast and self._going(driver):
            return self._runnable(driver)
        return waiting

    def _going(self, driver: sweep_driver.Driver) -> bool:
        return not driver.stopped and not (self.failed and self.fail_fast)

    def _runnable(self, driver: sweep_driver.Driver) -> Job | None:
        """The next trial's job that has to run, telling on the way those that do not
        (could not compose, or ended before); None when no trial is left to run."""
        while self._going(driver):
            job = self._next()
            if job is None or job.ret is None:
                return job
            self._tell(job, driver)
        return None

    def _next(self) -> Job | None:
        """The next trial's job: one cut off before first, then newly asked ones until the
        study holds ``n_trials``; None when none is left."""
        if self.cut_off:
            return self._job(self.cut_off.pop(0))
        if self.to_ask:
            self.to_ask -= 1
            return self._job(self.study.ask(self.space))
        return None

    def _job(self, trial: Any) -> Job:
        """The job of ``trial`` (asked now, or cut off before): its parameters as overrides
        after the fixed ones, job number and dir = the trial's number."""
        overrides = self.fixed + sweep_space.as_overrides(trial.params)
        job = sweep_driver.prepare(self.sweep.hydra, overrides, trial.number, self.sweep_dir)
        job.env = pruning.trial_env(str(self.sweep_dir / JOURNAL), self.study.study_name,
                                    trial._trial_id, self.settings.pruner)
        self.jobs.append(job)
        if job.ret is None and _metrics(job).get("status") == "pruned":
            # Pruned, but the search was cut off before it was told: tell it now.
            job.ret = JobReturn(overrides=job.overrides, cfg=job.config,
                                      status=JobStatus.COMPLETED, _return_value=None)
        return job

    # ------------------------------------------------------------------ tell
    def _tell(self, job: Job, driver: sweep_driver.Driver) -> None:
        """Tell the study how ``job``'s trial ended (see the module docstring)."""
        ret = job.ret
        assert ret is not None
        status = _metrics(job).get("status")
        if ret.status != JobStatus.COMPLETED:
            if driver.stopped:
                return  # cut off: RUNNING in the study, resumed by resume=auto
            self.failed = True
            self._tell_state(job.idx, "fail", job_error(ret))
            return
        value = ret._return_value
        if status == "pruned":
            self._tell_state(job.idx, "pruned", f"after {_metrics(job).get('epochs')} epoch(s)")
        elif status == "diverged":
            self._tell_state(job.idx, "fail", "the loss diverged")
        elif not isinstance(value, (int, float)) or not math.isfinite(value):
            self._tell_state(job.idx, "fail", f"its monitored value is {value!r}")
        else:
            self.study.tell(job.idx, float(value))
            best = self.study.best_trial
            log.info("\ttrial %d: %s = %.4f (best so far: %.4f, trial %d)", job.idx,
                     self.monitor, value, best.value, best.number)

    def _tell_state(self, number: int, state: str, why: str) -> None:
        from optuna.trial import TrialState

        self.study.tell(number, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
        log.info("\ttrial %d: %s (%s)", number, "pruned" if state == "pruned" else "failed", why)

    # ------------------------------------------------------------------ results
    def _results(self) -> dict | None:
        """Print the best trial and write ``optimization_results.yaml``."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        counts = {s.name.lower(): sum(t.state == s for t in trials)
                  for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL,
                            TrialState.RUNNING)}
        if not counts["complete"]:
            return None
        best = self.study.best_trial
        results = {
            "name": "optuna_async",
            "study_name": self.study.study_name,
            "direction": self.study.direction.name.lower(),
            "best_trial": best.number,
            "best_params": dict(best.params),
            "best_value": best.value,
            "trials": counts,
        }
        (self.sweep_dir / RESULTS).write_text(yaml.safe_dump(results, sort_keys=False))
        log.info("best of %d trial(s) (%s): trial %d, %s = %.4f\n  %s\n(written to %s)",
                 len(trials), ", ".join(f"{n} {k}" for k, n in counts.items() if n),
                 best.number, self.monitor, best.value,
                 " ".join(sweep_space.as_overrides(best.params)), self.sweep_dir / RESULTS)
        return {"number": best.number, "params": dict(best.params), "value": best.value}


def _metrics(job: Job) -> dict:
    return read_metrics_or_empty(job.dir) if job.dir is not None else {}
