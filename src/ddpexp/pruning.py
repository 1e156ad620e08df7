"""Pruning of an ``optuna_async`` trial from inside its run.

The asynchronous Optuna sweeper (``hydra/sweeper=optuna_async``) starts each trial's job with
``DDPEXP_OPTUNA_TRIAL`` in its environment, which every worker of the job inherits: a JSON
object naming the study's journal file, the study, the trial and the pruner. :func:`from_env`
turns it into a :class:`Reporter` (``None`` outside a trial); the trainer's global rank 0 asks
:meth:`Reporter.should_prune` after each validation and shares the answer with the other
ranks. The pruner is built here, from the same description, both by the sweeper and in the
trial (optuna keeps pruners out of its storage). optuna is imported only when a trial reports.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional

from ddpexp.errors import ConfigError

ENV = "DDPEXP_OPTUNA_TRIAL"
PRUNERS = ("none", "median", "successive_halving", "asha", "hyperband")


def journal_storage(path: str) -> Any:
    """optuna's journal storage on the file ``path`` (safe for several processes at once)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    # An open(O_EXCL) lock works on file systems without symlinks (some network mounts).
    return JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


def build_pruner(spec: Mapping[str, Any]) -> Any:
    """The optuna pruner that ``spec`` (``hydra.sweeper.pruner``) describes; steps are epochs."""
    import optuna

    name = str(spec.get("name", "none")).lower()
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=int(spec.get("n_startup_trials", 5)),
                                           n_warmup_steps=int(spec.get("n_warmup_steps", 0)))
    if name in ("successive_halving", "asha"):
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=int(spec.get("min_resource", 1)),
            reduction_factor=int(spec.get("reduction_factor", 3)))
    if name == "hyperband":
        max_resource = spec.get("max_resource")
        return optuna.pruners.HyperbandPruner(
            min_resource=int(spec.get("min_resource", 1)),
            max_resource="auto" if max_resource is None else int(max_resource),
            reduction_factor=int(spec.get("reduction_factor", 3)))
    raise ConfigError(f"hydra.sweeper.pruner.name={name} is not one of {', '.join(PRUNERS)}")


def trial_env(journal: str, study: str, trial_id: int, pruner: Mapping[str, Any]) -> dict[str, str]:
    """The environment that makes a job process (and its workers) optuna trial ``trial_id``."""
    spec = {"journal": str(journal), "study": study, "trial_id": int(trial_id),
            "pruner": dict(pruner)}
    return {ENV: json.dumps(spec)}


def in_trial() -> bool:
    """Whether this process runs an ``optuna_async`` trial (every rank can tell, cheaply)."""
    return bool(os.environ.get(ENV))


def from_env() -> Optional["Reporter"]:
    """The reporter of this run's trial, or ``None`` unless this run is an ``optuna_async``
    trial. Cheap: the study is opened at the first report."""
    text = os.environ.get(ENV)
    if not text:
        return None
    spec = json.loads(text)
    return Reporter(spec["journal"], spec["study"], int(spec["trial_id"]), spec.get("pruner") or {})


class Reporter:
    """Reports a trial's monitored metric to its study once per epoch and asks the pruner."""

    def __init__(self, journal: str, study: str, trial_id: int, pruner: Mapping[str, Any]) -> None:
        self.journal, self.study_name, self.trial_id = journal, study, trial_id
        self.pruner_spec = dict(pruner)
        self._trial: Any = None

    def _open(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=self.study_name, storage=journal_storage(self.journal),
                                  # The trial samples nothing: its parameters came with its job.
                                  sampler=optuna.samplers.RandomSampler(),
                                  pruner=build_pruner(self.pruner_spec))
        return optuna.trial.Trial(study, self.trial_id)

    def should_prune(self, epoch: int, value: float) -> bool:
        """Report ``value`` (the monitored metric after epoch ``epoch``) and return whether
        the pruner stops the trial here. A non-finite value is not reported (the run stops as
        diverged on its own)."""
        if value is None or not math.isfinite(float(value)):
            return False
        if self._trial is None:
            self._trial = self._open()
        self._trial.report(float(value), int(epoch))
        return bool(self._trial.should_prune())
