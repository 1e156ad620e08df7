"""What a run's parent hands to its workers: one :class:`RunSpec`, built once.

The parent composes the config with Hydra, checks it and lays the run out; from then on the
run is this spec. The fan-out, torch elastic's agent, the ranks another launcher started and
the workers all read it, and no one past the parent sees a ``DictConfig``. It holds the
resolved config twice over, each form for one kind of reader: ``config``, plain Python with
enums as strings, for ``hydra.utils.instantiate`` and the checkpoints; ``trainer``, the typed
:class:`~ddpexp.config.schema.TrainerConfig` (enums as enums), for code. Both say the same,
since the one is made from the other here.

It travels as a pickle to the workers torch elastic spawns (GPU runs; CPU workers are forked
and inherit it), and as JSON through the store of the ranks another launcher started, where
what arrives over the network is read as data (:meth:`RunSpec.to_json`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpexp.config.modes import RunMode, from_dict, mode_class, to_dict
from ddpexp.config.monitor import with_monitor
from ddpexp.config.schema import TrainerConfig, trainer_config
from ddpexp.errors import ConfigError


@dataclass(frozen=True)
class Plan:
    """How a run is laid out: the strategy and the workers per node and in all."""

    strategy: Any  # trainer.strategy with auto resolved: a name, a class path or a _target_ node
    procs: int
    nodes: int
    gpus: int

    @property
    def world_size(self) -> int:
        return self.procs * self.nodes


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs, decided by the parent: the resolved config (``config``,
    plain; ``trainer``, typed), the layout, where to write, what to resume from, and the run
    mode (:mod:`ddpexp.config.modes`: train, or for ``ddpexp.eval`` evaluate a checkpoint)."""

    config: dict
    trainer: TrainerConfig
    plan: Plan
    run_dir: Path
    log_file: Path
    resume_from: Path | None = None
    # The overrides a sweep varies, for TensorBoard's HParams dashboard.
    hparams: dict = field(default_factory=dict)
    # The sweep dir of a sweep's job (trackers group its jobs by it); None for a single run.
    sweep_dir: Path | None = None
    # The worker runs in the parent's own process (one worker, no restarts).
    in_process: bool = False
    # What the workers do (ddpexp.modes): train unless the parent says otherwise.
    mode: RunMode = field(default_factory=lambda: mode_class("train")())
    # What this resume changes against the checkpoint's config, each change the parent let
    # through: [{"key", "from", "to"}] (ddpexp.config.resume).
    resume_changes: list = field(default_factory=list)
    # Where the run came from, as the parent saw it, for provenance.json: the command line
    # as typed, this job's overrides, the working and config dirs, the launcher.
    origin: dict = field(default_factory=dict)

    @classmethod
    def build(cls, config: Mapping[str, Any], plan: Plan, run_dir: Path, log_file: Path,
              **rest: Any) -> RunSpec:
        """The spec of a run of the resolved plain ``config`` laid out as ``plan``: the
        layout's strategy and procs written into (a copy of) the config, the task's monitor
        filled in where the config leaves it null. ``rest``: the other fields."""
        plain = copy.deepcopy(dict(config))
        plain["trainer"] = {**plain["trainer"], "strategy": plan.strategy, "procs": plan.procs}
        plain = with_monitor(plain)
        try:
            typed = trainer_config(plain["trainer"])
        except Exception as exc:  # omegaconf's ValidationError, ConfigKeyError: a bad key
            raise ConfigError(f"the trainer config is not valid: {exc}") from None
        return cls(config=plain, trainer=typed, plan=plan, run_dir=Path(run_dir),
                   log_file=Path(log_file), **rest)

    def to_json(self) -> str:
        """The spec as JSON (the config as it is, the typed trainer left out: it is made from
        the config again by :meth:`from_json`)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "trainer"}
        fields["plan"] = dataclasses.asdict(self.plan)
        fields["mode"] = to_dict(self.mode)
        for name, value in fields.items():
            if isinstance(value, Path):
                fields[name] = str(value)
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunSpec:
        """The spec :meth:`to_json` wrote."""
        fields = json.loads(text)
        for name in ("run_dir", "log_file", "resume_from", "sweep_dir"):
            if fields.get(name) is not None:
                fields[name] = Path(fields[name])
        fields["mode"] = from_dict(fields["mode"])
        plan = Plan(**fields.pop("plan"))
        return cls(trainer=trainer_config(fields["config"]["trainer"]), plan=plan, **fields)

