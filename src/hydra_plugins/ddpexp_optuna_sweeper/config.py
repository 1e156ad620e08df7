"""The ``optuna_async`` sweeper's config, registered under ``hydra/sweeper``."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore


@dataclass
class SamplerConf:
    """``hydra.sweeper.sampler.*``: how optuna picks each new trial's parameters."""

    # tpe | random | grid (grid: every parameter a choice(...) or range(...))
    name: str = "tpe"
    # The same seed asks the same first trials.
    seed: int | None = None


@dataclass
class PrunerConf:
    """``hydra.sweeper.pruner.*``: what stops a trial early; its steps are epochs."""

    # none | median | successive_halving (also: asha) | hyperband
    name: str = "none"
    # median: trials that must complete before any is pruned
    n_startup_trials: int = 5
    # median: epochs of every trial that are never pruned
    n_warmup_steps: int = 0
    # successive_halving, hyperband: epochs a trial runs before its first rung
    min_resource: int = 1
    # successive_halving, hyperband: 1/reduction_factor of the trials go on at each rung
    reduction_factor: int = 3
    # hyperband: the epochs of a full trial (null: learnt from the first completed trial)
    max_resource: int | None = None


@dataclass
class OptunaAsyncSweeperConf:
    """``hydra.sweeper.*`` keys of the asynchronous Optuna sweeper."""

    _target_: str = "hydra_plugins.ddpexp_optuna_sweeper.optuna_sweeper.OptunaAsyncSweeper"
    # Trials of the whole study, those of earlier (resumed) invocations included.
    n_trials: int = 20
    # maximize | minimize; null: from trainer.monitor_mode (max -> maximize)
    direction: str | None = None
    # The study's name in the journal file (<sweep dir>/optuna.journal).
    study_name: str = "ddpexp"
    sampler: SamplerConf = field(default_factory=SamplerConf)
    pruner: PrunerConf = field(default_factory=PrunerConf)
    # The search space as key: override value, e.g. {optimizer.lr: "tag(log, interval(1e-4, 1e-1))"};
    # search-space overrides on the command line are added (and win for the same key).
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="optuna_async",
                             node=OptunaAsyncSweeperConf, provider="ddpexp")
