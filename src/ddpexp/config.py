"""The typed part of ddpexp's configuration and the OmegaConf resolvers its YAML uses.

What code reads (the ``trainer`` node, ``seed``, ``resume``) is a dataclass in Hydra's
ConfigStore, so a typo such as ``trainer.gpu=4`` or ``trainer.strategy=dpp`` fails while the
config is composed, before anything runs. What users swap (``model``, ``data``, ``optimizer``,
``scheduler``) stays YAML with a ``_target_`` and is checked when it is instantiated.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.singleton import Singleton
from hydra.errors import HydraException
from hydra.version import VersionBase
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from ddpexp.errors import ConfigError
from ddpexp.monitor import fill_monitor


class Strategy(Enum):
    """How the workers of a run share the model."""

    auto = "auto"
    ddp = "ddp"
    fsdp = "fsdp"
    dp = "dp"
    single = "single"


class MonitorMode(Enum):
    """Whether a larger or a smaller monitored metric is better."""

    max = "max"
    min = "min"


PRECISIONS = ("32", "bf16", "16")


@dataclass
class FSDPConfig:
    """``trainer.fsdp.*``: how ``strategy=fsdp`` shards the model (docs/config.md)."""

    # Class names of the modules sharded as units, before the root; None = the model's
    # ddpexp_blocks(), else the built-in rule (ddpexp.blocks).
    wrap: Optional[list[str]] = None
    # Free each unit's gathered parameters after its forward (gathered again in backward):
    # less memory, one more all-gather per unit and step.
    reshard_after_forward: bool = True
    # Keep the parameter, gradient and optimizer shards in CPU memory (GPU runs).
    cpu_offload: bool = False


@dataclass
class TrainerConfig:
    """Everything the trainer and the fan-out read; docs/config.md explains each key."""

    # GPUs per node, one worker each (NCCL); 0 = CPU.
    gpus: int = 0
    # Workers per node; None = gpus if gpus > 0, else 1 (on the CPU, procs > 1 is gloo DDP).
    procs: Optional[int] = None
    # Nodes (torch elastic c10d rendezvous at rdzv_endpoint).
    nodes: int = 1
    # host:port of the rendezvous when nodes > 1.
    rdzv_endpoint: Optional[str] = None
    rdzv_timeout_s: int = 300
    strategy: Strategy = Strategy.auto
    # Kept small so that the default run is short.
    max_epochs: int = 10
    # Stop after this many optimizer steps in all (None = no limit).
    max_steps: Optional[int] = None
    # 32 | bf16 | 16 (fp16 with a gradient scaler, GPUs only).
    precision: str = "32"
    # Micro-batches per optimizer step (no_sync under DDP).
    accumulate: int = 1
    # strategy=fsdp's sharding (trainer.fsdp.wrap, reshard_after_forward, cpu_offload).
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    # Recompute each block's activations in the backward pass (ddp, fsdp, single): less
    # memory for one more forward per block.
    activation_checkpointing: bool = False
    # Max total gradient norm; None = off.
    grad_clip: Optional[float] = None
    # Whole-group restarts after a worker dies, each resuming from last.pt.
    max_restarts: int = 0
    # Collective timeout: a stuck rank fails the run instead of hanging it.
    dist_timeout_s: float = 300.0
    # A finite training loss this many times its start (the initial weights' loss) ends the
    # run as diverged, like a NaN one (ddpexp.divergence has the rule); None = NaN/inf only.
    divergence_factor: Optional[float] = 100.0
    log_every_n_steps: int = 20
    # Also write last.pt every N optimizer steps mid-epoch.
    ckpt_every_steps: Optional[int] = None
    # Any val/<name> the task returns; None = the task's own default (its class attributes).
    monitor: Optional[str] = None
    # max | min; None = the task's own default.
    monitor_mode: Optional[MonitorMode] = None
    # Validations without a strict improvement before stopping; None = never.
    early_stop_patience: Optional[int] = None
    # After training, evaluate best.pt on the data's test split (test/<name> in metrics.json);
    # selection (best.pt, early stopping, sweeps) never looks at it.
    test: bool = True
    sync_batchnorm: bool = False
    # torch.compile the training forward.
    compile: bool = False
    # channels_last memory format for the model and 4-d batches; None = on where the model
    # has 2-d convolutions and runs on the CPU or in bf16/16 on a GPU (measured faster).
    channels_last: Optional[bool] = None
    # None = on when stderr is a terminal.
    progress_bar: Optional[bool] = None
    # Seconds workers get to checkpoint and exit after a stop signal before they are killed.
    shutdown_grace_s: int = 30
    # DDP's find_unused_parameters: for models whose forward leaves some parameters out of
    # the loss (costs an extra graph traversal per step, so off unless asked for).
    find_unused_parameters: bool = False
    # Batches per worker per epoch (the first N of each epoch's shard); null = all.
    limit_train_batches: Optional[int] = None
    # Validation batches per worker; null = the whole validation set.
    limit_val_batches: Optional[int] = None
    # Train on the same first N batches every epoch, unshuffled, and validate on them.
    overfit_batches: Optional[int] = None
    # torch.profiler over N optimizer steps after 2 warm-up steps (profile/trace.json).
    profile_steps: Optional[int] = None
    # Keep the K best checkpoints by `monitor` besides last.pt and best.pt; null = none.
    save_top_k: Optional[int] = None
    # Exponential moving average of the weights (e.g. 0.999), used for validation, test,
    # best.pt and the sweep's value; null = off.
    ema_decay: Optional[float] = None
    # torch.autograd anomaly detection: the backward op that made a NaN/inf is named.
    detect_anomaly: bool = False
    # torch.use_deterministic_algorithms(True): ops without a deterministic kernel raise.
    deterministic: bool = False


@dataclass
class DdpexpConfig:
    """The root of the composed config; the groups fill the ``Any`` nodes."""

    task: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Dicts of entries by name, each built by its _target_ (ddpexp.components): the
    # callbacks (every rank) and the loggers (global rank 0).
    callbacks: Any = field(default_factory=dict)
    logger: Any = field(default_factory=dict)
    seed: int = 0
    resume: Optional[str] = None
    # Start a new run in a hydra.run.dir that already holds one, replacing it.
    overwrite: bool = False


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent) and register the resolvers."""
    ConfigStore.instance().store(name="ddpexp_schema", node=DdpexpConfig)
    ConfigStore.instance().store(group="trainer", name="base_trainer", node=TrainerConfig)
    if not OmegaConf.has_resolver("ddpexp.unique_dir"):
        OmegaConf.register_new_resolver("ddpexp.unique_dir", unique_dir, use_cache=True)
    if not OmegaConf.has_resolver("ddpexp.resume_dir"):
        OmegaConf.register_new_resolver("ddpexp.resume_dir", resume_dir)
    if not OmegaConf.has_resolver("ddpexp.hydra_subdir"):
        OmegaConf.register_new_resolver("ddpexp.hydra_subdir", hydra_subdir)


# Hydra resolves hydra.run.dir / hydra.sweep.dir several times in one process (the sweeper
# creates the sweep dir, the launcher reads it again). Each must see the same answer, so
# the dir made for a requested path is remembered for the life of the process.
_CLAIMED: dict[str, str] = {}


def unique_dir(path: str) -> str:
    """Claim ``path``, or ``path-1``, ``path-2``... if another run got there first.

    ``os.mkdir`` is atomic, so two runs started in the same second never share a dir. The
    claim is remembered by absolute path: the same relative path from another working
    directory (several runs in one process) is another dir.
    """
    key = str(Path(path).absolute())
    if key in _CLAIMED:
        return _CLAIMED[key]
    base = Path(path)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(unwritable_dir_message(base, exc)) from None
    for n in range(10_000):
        candidate = base if n == 0 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(unwritable_dir_message(candidate, exc)) from None
        _CLAIMED[key] = str(candidate)
        return str(candidate)
    raise ConfigError(f"could not create a fresh run dir next to {path}")


def claimed_dirs() -> set[str]:
    """The run and sweep dirs this process created (absolute paths)."""
    return {str(Path(key).parent / Path(d).name) for key, d in _CLAIMED.items()}


def unwritable_dir_message(path: Path, exc: OSError) -> str:
    """Why a run dir cannot be made at ``path``, and what to do about it."""
    why = exc.strerror or str(exc)
    return (f"cannot create the run dir {path}: {why}. Run from a directory you can write to, "
            "or point hydra.run.dir (hydra.sweep.dir for -m) at one")


def writable_dir_problem(path: Path) -> Optional[str]:
    """A message if no run dir can be created at ``path`` (a forbidden, read-only or
    unwritable place); creates nothing that stays."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot create the run dir {path}: {probe} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return unwritable_dir_message(Path(path), exc)
    return None


def resume_dir(resume: Any, fresh: str) -> str:
    """The run dir: the one ``resume`` points at (dir or checkpoint file), else ``fresh``.

    ``fresh`` is only claimed (created) when it is the answer, so resuming into an old run
    leaves no empty new dir behind.
    """
    if resume not in (None, "", "auto"):
        target = Path(str(resume)).expanduser()
        if target.is_file() and target.parent.name == "checkpoints":
            return str(target.parent.parent)
        if target.is_dir():
            return str(target)
    return unique_dir(fresh)


def hydra_subdir(output_dir: str) -> Optional[str]:
    """Where Hydra saves this job's config: ``.hydra``, or ``.hydra/resume-N`` when the dir
    already holds a run, so resuming never overwrites the config the run started with.
    ``None`` (nothing saved) in the tasks other than global rank 0 of a SLURM step that all
    run Hydra (a submitit job of several tasks): rank 0 saves it once."""
    if _later_slurm_task():
        return None
    first = Path(output_dir) / ".hydra"
    if not (first / "config.yaml").exists():
        return ".hydra"
    n = 1
    while (first / f"resume-{n}").exists():
        n += 1
    return f".hydra/resume-{n}"


def _later_slurm_task() -> bool:
    env = os.environ
    try:
        return (int(env.get("SLURM_PROCID", "0")) > 0 and int(env.get("SLURM_NTASKS", "1")) > 1
                and "TORCHELASTIC_RUN_ID" not in env)
    except ValueError:
        return False


def trainer_config(node: Any) -> TrainerConfig:
    """The ``trainer`` node (a DictConfig or the plain dict workers receive) as the typed
    :class:`TrainerConfig`, enums and all."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainerConfig), node)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def compose_single_process(overrides: list[str], config_dir: Optional[Path] = None) -> dict:
    """The resolved config (plain Python, as a worker receives it) for ``overrides``, for a
    trainer built in this process: one process (``strategy=single``), the task's monitor
    filled in as a run's parent does. ``config_dir`` is a user's own config dir
    (``--config-dir``). For tests and measurements that build the trainer directly."""
    register_configs()
    extra = [f"hydra.searchpath=[file://{config_dir}]"] if config_dir else []
    try:
        with initialize_config_module(version_base="1.3", config_module="ddpexp.conf"):
            cfg = compose("config", overrides=[*overrides, *extra])
    finally:
        # initialize_* leaves its version base in a process-wide singleton; Hydra's launcher
        # plugins, run later in the same process, expect the unspecified (pre-1.2) default.
        Singleton._instances.pop(VersionBase, None)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    plain = to_plain(cfg)
    plain["trainer"]["strategy"] = "single"
    fill_monitor(plain)
    return plain


def to_plain(cfg: DictConfig) -> dict:
    """The fully resolved config as plain Python (enums as strings): what workers receive
    and what checkpoints store."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def validate(cfg: DictConfig) -> None:
    """Checks that the types alone cannot express; each failure names the allowed values."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            "these keys need a value: " + ", ".join(missing)
            + " (e.g. data.root=/path/to/images for data=imagefolder)"
        )
    t = cfg.trainer
    if str(t.precision) not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={t.precision!r} is not one of {', '.join(PRECISIONS)}"
        )
    for key in ("gpus", "nodes", "accumulate", "max_epochs", "log_every_n_steps"):
        value = t[key]
        low = 0 if key == "gpus" else 1
        if value < low:
            raise ConfigError(f"trainer.{key}={value} must be >= {low}")
    if t.procs is not None and t.procs < 1:
        raise ConfigError(f"trainer.procs={t.procs} must be >= 1 (or null)")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={t.max_steps} must be >= 1 (or null)")
    for key in ("limit_train_batches", "limit_val_batches", "overfit_batches", "profile_steps",
                "save_top_k"):
        if t[key] is not None and t[key] < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 1 (or null)")
    if t.ema_decay is not None and not 0.0 <= t.ema_decay < 1.0:
        raise ConfigError(f"trainer.ema_decay={t.ema_decay} must be in [0, 1) (e.g. 0.999), or null")
    if t.max_restarts < 0:
        raise ConfigError(f"trainer.max_restarts={t.max_restarts} must be >= 0")
    if t.dist_timeout_s <= 0:
        raise ConfigError(f"trainer.dist_timeout_s={t.dist_timeout_s} must be > 0")
    _validate_ranges(cfg)
    if t.nodes > 1 and not t.rdzv_endpoint:
        raise ConfigError(
            f"trainer.nodes={t.nodes} needs trainer.rdzv_endpoint=HOST:PORT, the same on every "
            "node (HOST is the first node's address)"
        )
    if t.monitor is not None and not str(t.monitor).startswith("val/"):
        raise ConfigError(
            f"trainer.monitor={t.monitor!r}: the monitored metric is a validation metric, "
            "val/<name> for a name the task returns (e.g. val/loss)"
        )
    if str(t.precision) == "16" and t.gpus == 0:
        raise ConfigError(
            "trainer.precision=16 (fp16 with a gradient scaler) needs a GPU; "
            "on the CPU use trainer.precision=bf16"
        )
    if t.sync_batchnorm and t.gpus == 0 and (t.procs or 1) * t.nodes > 1:
        raise ConfigError(
            "trainer.sync_batchnorm=true needs GPUs: torch's SyncBatchNorm has no CPU kernel. "
            "On the CPU leave it off (each rank then keeps its own BatchNorm statistics; "
            "validation and checkpoints use rank 0's)"
        )
    for group in ("task", "model", "data", "optimizer"):
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"the {group} config has no _target_; pick one with {group}=NAME "
                f"or give a YAML with _target_"
            )


# (key, lowest allowed, whether the lowest is excluded, what the value means): values that
# the types accept but that cannot work.
_RANGES = (
    ("trainer.grad_clip", 0, True, "the max gradient norm; null turns clipping off"),
    ("trainer.early_stop_patience", 1, False, "validations without improvement; null = never stop"),
    ("trainer.ckpt_every_steps", 1, False, "optimizer steps between checkpoints; null = at epoch ends"),
    ("trainer.shutdown_grace_s", 0, False, "seconds to checkpoint after a stop signal"),
    ("trainer.rdzv_timeout_s", 0, True, "seconds the nodes wait for each other"),
    ("trainer.divergence_factor", 1, True,
     "how many times its start the training loss may rise to before the run counts as "
     "diverged; null = only a NaN or infinite loss"),
    ("seed", 0, False, "the base seed"),
    ("optimizer.lr", 0, False, "the learning rate"),
    ("data.num_workers", 0, False, "DataLoader worker processes per rank"),
)


def _validate_ranges(cfg: DictConfig) -> None:
    """Numbers out of range, and data keys the YAML leaves untyped (``data.batch_size=1.5``)."""
    for key, low, strict, meaning in _RANGES:
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number ({meaning})")
        if value < low or (strict and value == low):
            bound = f"> {low}" if strict else f">= {low}"
            raise ConfigError(f"{key}={value} must be {bound} ({meaning})")
    data = cfg.get("data")
    if not isinstance(data, DictConfig):
        return
    for key, low, nullable in (("batch_size", 1, False), ("prefetch_factor", 1, True)):
        if key not in data:
            continue
        value = data[key]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"data.{key}={value!r} must be >= {low}, a whole number"
                              + (", or null" if nullable else ""))
    if data.get("prefetch_factor") is not None and not data.get("num_workers"):
        raise ConfigError(
            f"data.prefetch_factor={data.prefetch_factor} needs data.num_workers > 0 (it is "
            "how many batches each loader worker prepares ahead); set data.num_workers or "
            "leave data.prefetch_factor=null"
        )


def unknown_trainer_keys(args: list[str]) -> Optional[str]:
    """A message for ``trainer.KEY=...`` overrides whose KEY is no trainer key, naming the
    closest one. Hydra rejects them too, but suggests ``+trainer.KEY`` (adding a key the
    trainer never reads), which is the wrong fix for a typo."""
    known = [f.name for f in fields(TrainerConfig)]
    problems = []
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+")  # +trainer.x would be kept, and never read
        if "=" not in arg or not key.startswith("trainer.") or key.count(".") != 1:
            continue
        name = key.split(".", 1)[1]
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean trainer.{close[0]}?" if close else "it is not a trainer key"
            problems.append(f"trainer.{name}: {hint}")
    if not problems:
        return None
    return ("unknown trainer key " + "; ".join(problems)
            + f"\n(trainer keys: {', '.join(known)})")


# A sweep's value (``a,b``, ``range(3)``) in :func:`command_line_values`.
SWEPT = object()


def command_line_values(args: Sequence[str]) -> dict[str, Any]:
    """The overrides on the command line ``args`` as Hydra itself reads them, by key (its
    ``+``/``++`` prefix dropped): quotes and escapes undone, so that
    ``'hydra.run.dir="outputs/my run"'`` and ``hydra.run.dir=outputs/my\\ run`` both give
    ``"outputs/my run"``, and ``null``, numbers and booleans typed. A sweep's value is
    :data:`SWEPT`. Flags, their values, deletions (``~key``) and what Hydra cannot parse (it
    reports that itself) are left out."""
    parser = OverridesParser.create()
    values: dict[str, Any] = {}
    for arg in args:
        if arg.startswith("-"):
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue
        if override.is_delete():
            continue
        values[override.key_or_group] = SWEPT if override.is_sweep_override() else override.value()
    return values


def command_line_override(key: str, value: Any) -> str:
    """``key=value`` as one shell word that Hydra reads back as ``value``: quoted for Hydra
    where its grammar would read the bare value otherwise (spaces at the ends, non-ASCII
    letters, ``null``...), then for the shell. ``resume=outputs/run`` stays as it is;
    ``outputs/my run é`` becomes ``'resume="outputs/my run é"'``."""
    text = str(value)
    bare = f"{key}={text}"
    try:
        if OverridesParser.create().parse_override(bare).value() == text:
            return shlex.quote(bare)
    except HydraException:
        pass
    # In Hydra's quoted strings only backslashes before a quote (or the closing one) escape.
    escaped = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""),
                     text)
    return shlex.quote(f'{key}="{escaped}"')


def preflight(args: list[str]) -> Optional[str]:
    """Checks of the command line that must happen before Hydra claims a run dir: trainer
    key typos, a run dir that already holds a run, and a ``resume=`` path that does not
    exist (which would otherwise leave an empty new run dir behind its error)."""
    typo = unknown_trainer_keys(args)
    if typo:
        return typo
    taken = existing_run_overwritten(args)
    if taken:
        return taken
    resume = command_line_values(args).get("resume")
    if isinstance(resume, str) and resume not in ("", "auto") and not Path(resume).expanduser().exists():
        return f"resume={resume} is neither auto, a run dir nor a checkpoint file that exists"
    return None


# What a run writes into its dir; overwrite=true removes these before the new run starts.
RUN_OUTPUTS = (".hydra", "checkpoints", "tb", "metrics.json", "metrics.csv")


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds (part of) a ddpexp run: its config, checkpoints or metrics."""
    return any((path / name).exists() for name in (".hydra/config.yaml", "checkpoints", "metrics.json"))


def _shares_run_dir(values: dict[str, Any]) -> bool:
    """Processes that share one run dir by design: a submitit job requeued into its own dir,
    the nodes of a multi-node run on a shared filesystem. (Of a SLURM step's tasks only rank
    0 runs this check; the others take the run dir it chose.)"""
    env = os.environ
    if any(k.startswith("SUBMITIT_") for k in env):
        return True
    nodes = values.get("trainer.nodes", 1)
    return isinstance(nodes, int) and nodes > 1


def existing_run_overwritten(args: list[str]) -> Optional[str]:
    """A message when ``hydra.run.dir`` (or a sweep's ``hydra.sweep.dir``) names a dir that
    already holds a run and neither ``resume=`` nor ``overwrite=true`` says what to do with it;
    with ``overwrite=true`` the old run's outputs are removed first. Checked before Hydra
    writes anything into the dir, on the path Hydra will use (however it was quoted)."""
    values = command_line_values(args)
    multirun = any(a in ("-m", "--multirun") for a in args)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    target = values.get(key)
    target = None if target is None or target is SWEPT or "${" in str(target) else str(target)
    # The default run and sweep dirs are under ./outputs.
    problem = writable_dir_problem(Path(target or "outputs"))
    if problem:
        return problem
    if target is None:
        return None
    path = Path(target).expanduser()
    runs = [path] if not multirun else [d for d in path.iterdir() if d.is_dir()] if path.is_dir() else []
    runs = [d for d in runs if holds_run(d)]
    if not runs or values.get("resume") not in (None, "") or _shares_run_dir(values):
        return None
    if str(values.get("overwrite", False)).lower() in ("true", "1", "yes", "on"):
        for run in runs:
            for name in (*RUN_OUTPUTS, *(p.name for p in run.glob("*.log"))):
                victim = run / name
                if victim.is_dir():
                    shutil.rmtree(victim)
                elif victim.exists():
                    victim.unlink()
        return None
    what = f"{command_line_override(key, target)} already holds " + (
        "a run" if not multirun else f"{len(runs)} run(s) of an earlier sweep")
    resume_hint = "resume=auto" if multirun else command_line_override("resume", target)
    return (f"{what}; a new run there would overwrite its checkpoints and metrics.json. "
            f"Continue it with {resume_hint}, start it over with overwrite=true "
            f"(removes its outputs first), or pick another {key}")


def env_flag(name: str) -> bool:
    """True when an environment variable is set to something other than 0/false/empty."""
    return os.environ.get(name, "").lower() not in ("", "0", "false", "no")
