"""``callbacks.pruning``: the ``optuna_async`` search's pruning, from inside a trial.

The asynchronous Optuna sweeper (``hydra/sweeper=optuna_async``, :mod:`ddpexp.sweep.search`)
starts each trial's job with ``DDPEXP_OPTUNA_TRIAL`` in its environment, which every worker of
the job inherits: a JSON object naming the study's journal file, the study, the trial and the
pruner (:func:`ddpexp.runtime.trial.trial_env`). Only in such a run is the callback active:
after each validation global rank 0 reports the monitored value to the study through a
:class:`Reporter` and asks the pruner; the answer reaches every rank in one small broadcast.
On a prune this callback asks for the stop (``trainer.request_stop(..., status="pruned")``);
the trainer's agreement then ends the run after that epoch, whose checkpoint the checkpoint
callback still writes, with status ``pruned``. optuna is imported only when a trial reports.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddpexp.callbacks.base import Callback, TrainerView
from ddpexp.runtime.trial import ENV, build_pruner, journal_storage


class OptunaPruning(Callback):
    """Reports each validation of an ``optuna_async`` trial; off outside a trial."""

    def __init__(self) -> None:
        self.enabled = in_trial()
        self.reporter: Any = None

    def setup(self, trainer: TrainerView) -> None:
        self.reporter = from_env() if trainer.is_main else None

    def on_validation_end(self, trainer: TrainerView, metrics: Mapping[str, float]) -> None:
        value = float(metrics[trainer.monitor])
        flag = torch.zeros(1, dtype=torch.int32, device=trainer.device)
        if self.reporter is not None:
            flag[0] = int(self.reporter.should_prune(trainer.epoch, value))
        if trainer.world_size > 1:
            dist.broadcast(flag, src=0)
        if flag.item():
            trainer.request_stop(f"pruned by the search after epoch {trainer.epoch} "
                                 f"({trainer.monitor} {value:.4f})", status="pruned")

def in_trial() -> bool:
    """Whether this process runs an ``optuna_async`` trial (every rank can tell, cheaply)."""
    return bool(os.environ.get(ENV))


def from_env() -> Reporter | None:
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
