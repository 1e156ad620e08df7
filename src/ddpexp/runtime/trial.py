"""What makes a job an ``optuna_async`` trial, shared by the search that starts it
(:mod:`ddpexp.sweep.search`) and the callback that reports from inside it
(:mod:`ddpexp.callbacks.pruning`): the environment a trial's job is started with, the study's
journal storage, and the pruner built from its description (on both sides, since optuna keeps
pruners out of its storage)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

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
