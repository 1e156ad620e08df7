"""The typed part of ddpexp's configuration and the OmegaConf resolvers its YAML uses.

What code reads (the ``trainer`` node, ``seed``, ``resume``) is a dataclass in Hydra's
ConfigStore, so a typo such as ``trainer.gpu=4`` or ``trainer.max_epochs=abc`` fails while the
config is composed, before anything runs. What users swap (``model``, ``data``, ``optimizer``,
``scheduler``) stays YAML with a ``_target_`` and is checked when it is instantiated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from ddpexp.config.rundir import claimed_subdir, resume_dir, unique_dir


class MonitorMode(StrEnum):
    """Whether a larger or a smaller monitored metric is better (a string: ``"max"``)."""

    max = "max"
    min = "min"


PRECISIONS = ("32", "bf16", "16")


@dataclass
class FSDPConfig:
    """``trainer.fsdp.*``: how ``strategy=fsdp`` shards the model (docs/config.md)."""

    # Class names of the modules sharded as units, before the root (one name or a list);
    # None = the model's ddpexp_blocks(), else the built-in rule (ddpexp.strategies.blocks).
    # Typed Any so that trainer.fsdp.wrap=Linear is accepted as [Linear].
    wrap: Any = None
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
    procs: int | None = None
    # Nodes (torch elastic c10d rendezvous at rdzv_endpoint).
    nodes: int = 1
    # host:port of the rendezvous when nodes > 1.
    rdzv_endpoint: str | None = None
    rdzv_timeout_s: int = 300
    # How the workers share the model: a name of ddpexp.strategies.registry (auto, ddp, fsdp,
    # dp, single), a strategy class's dotted path, or a node with _target_ (and keyword
    # arguments of the class). Typed Any so that it may be a node; the launching process
    # resolves it and refuses an unknown name.
    strategy: Any = "auto"
    # Kept small so that the default run is short.
    max_epochs: int = 10
    # Stop after this many optimizer steps in all (None = no limit).
    max_steps: int | None = None
    # 32 | bf16 | 16 (fp16 with a gradient scaler, GPUs only).
    precision: str = "32"
    # Micro-batches per optimizer step (no_sync under DDP).
    accumulate: int = 1
    # Tensor-parallel degree: each model-parallel group of tp ranks splits the model by its
    # plan (ddpexp.strategies.tp); the data-parallel degree is the world size / tp. With
    # strategy=fsdp, a 2-D mesh: FSDP over the data-parallel dimension, TP inside.
    tp: int = 1
    # strategy=fsdp's sharding (trainer.fsdp.wrap, reshard_after_forward, cpu_offload).
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    # Recompute each block's activations in the backward pass (ddp, fsdp, single): less
    # memory for one more forward per block.
    activation_checkpointing: bool = False
    # Max total gradient norm; None = off.
    grad_clip: float | None = None
    # Whole-group restarts after a worker dies, each resuming from last.pt.
    max_restarts: int = 0
    # Collective timeout: a stuck rank fails the run instead of hanging it.
    dist_timeout_s: float = 300.0
    # A finite training loss this many times its start (the initial weights' loss) ends the
    # run as diverged, like a NaN one (ddpexp.training.divergence has the rule); None = NaN/inf only.
    divergence_factor: float | None = 100.0
    log_every_n_steps: int = 20
    # Also write last.pt every N optimizer steps mid-epoch.
    ckpt_every_steps: int | None = None
    # Copy each checkpoint to host memory at its step and write it in a background thread
    # (one at a time) while training goes on; None = where the copy fits in half the memory
    # available, true = always, false = write in the loop. strategy=fsdp writes in the loop.
    async_save: bool | None = None
    # Any val/<name> the task returns; None = the task's own default (its class attributes).
    monitor: str | None = None
    # max | min; None = the task's own default.
    monitor_mode: MonitorMode | None = None
    # Validations without a strict improvement before stopping; None = never.
    early_stop_patience: int | None = None
    # After training, evaluate best.pt on the data's test split (test/<name> in metrics.json);
    # selection (best.pt, early stopping, sweeps) never looks at it.
    test: bool = True
    sync_batchnorm: bool = False
    # torch.compile the training forward.
    compile: bool = False
    # channels_last memory format for the model and 4-d batches; None = on where the model
    # has 2-d convolutions and runs on the CPU or in bf16/16 on a GPU (measured faster).
    channels_last: bool | None = None
    # None = on when stderr is a terminal.
    progress_bar: bool | None = None
    # Seconds workers get to checkpoint and exit after a stop signal before they are killed.
    shutdown_grace_s: int = 30
    # DDP's find_unused_parameters: for models whose forward leaves some parameters out of
    # the loss (costs an extra graph traversal per step, so off unless asked for).
    find_unused_parameters: bool = False
    # Batches per worker per epoch (the first N of each epoch's shard); null = all.
    limit_train_batches: int | None = None
    # Validation batches per worker; null = the whole validation set.
    limit_val_batches: int | None = None
    # Train on the same first N batches every epoch, unshuffled, and validate on them.
    overfit_batches: int | None = None
    # torch.profiler over N optimizer steps after 2 warm-up steps (profile/trace.json).
    profile_steps: int | None = None
    # Keep the K best checkpoints by `monitor` besides last.pt and best.pt; null = none.
    save_top_k: int | None = None
    # Exponential moving average of the weights (e.g. 0.999), used for validation, test,
    # best.pt and the sweep's value; null = off.
    ema_decay: float | None = None
    # torch.autograd anomaly detection: the backward op that made a NaN/inf is named.
    detect_anomaly: bool = False
    # torch.use_deterministic_algorithms(True): ops without a deterministic kernel raise.
    deterministic: bool = False

    @property
    def blocks(self) -> Any:
        """The model's blocks, as a rule (docs/config.md): what activation checkpointing
        recomputes under every strategy, and the units ``strategy=fsdp`` shards. Written
        ``trainer.fsdp.wrap``, where it began; the rest of ``fsdp`` is that strategy's
        own, read by it alone."""
        return self.fsdp.wrap


@dataclass
class DdpexpConfig:
    """The root of the composed config; the groups fill the ``Any`` nodes."""

    task: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Dicts of entries by name, each built by its _target_ (ddpexp.config.components): the
    # callbacks (every rank) and the loggers (global rank 0).
    callbacks: Any = field(default_factory=dict)
    logger: Any = field(default_factory=dict)
    seed: int = 0
    resume: str | None = None
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
        OmegaConf.register_new_resolver("ddpexp.hydra_subdir", claimed_subdir)


def for_evaluation(cfg: DictConfig, given: set[str], is_builtin: Callable[[Any], bool],
                   auto: str) -> None:
    """The trainer of a training run's config (``cfg``, changed in place) made an
    evaluation's, for each key the command did not set (``given``): a built-in strategy
    (``is_builtin``) was resolved for the training run's workers, so it is decided afresh
    (``auto``) for the workers asked for now, while a user's own class is kept; an evaluation
    is never restarted; the training run's cut of its validation (debug=fast's 2 batches per
    worker) is not what an evaluation asks for, so it takes the whole split; and ``procs``
    follows a new ``gpus``."""
    strategy = OmegaConf.select(cfg, "trainer.strategy")
    builtin = not OmegaConf.is_config(strategy) and is_builtin(strategy)
    unless_given = {
        **({"trainer.strategy": auto} if builtin else {}),
        "trainer.max_restarts": 0,
        "trainer.limit_val_batches": None,
        **({"trainer.procs": None} if "trainer.gpus" in given else {}),
    }
    for key, value in unless_given.items():
        if key not in given:
            OmegaConf.update(cfg, key, value, force_add=True)


def trainer_of(config: Mapping[str, Any]) -> TrainerConfig:
    """The typed trainer of a whole config (composed, or plain as a checkpoint holds it):
    :func:`trainer_config` of its ``trainer`` node."""
    return trainer_config(config["trainer"])


def trainer_config(node: Any) -> TrainerConfig:
    """The ``trainer`` node (a DictConfig or a resolved plain dict) as the typed
    :class:`TrainerConfig`, enums and all: the one place the node becomes that object, for
    a spec built in the run's parent and for one that arrives as JSON alike. A key or value
    the schema does not allow is refused (omegaconf's ``ConfigKeyError``,
    ``ValidationError``)."""
    merged = OmegaConf.merge(trainer_schema(), node)  # merge copies the schema
    return OmegaConf.to_object(merged)  # pyright: ignore[reportReturnType]  # a structured TrainerConfig node converts to that dataclass


@functools.cache
def trainer_schema() -> DictConfig:
    """:class:`TrainerConfig` as a structured config, made once (5 ms each time)."""
    return OmegaConf.structured(TrainerConfig)


def to_plain(cfg: DictConfig) -> dict:
    """The fully resolved config as plain Python (enums as strings): what a
    :class:`~ddpexp.config.spec.RunSpec` holds for workers and what checkpoints store."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # pyright: ignore[reportReturnType]  # the root node is a dict
