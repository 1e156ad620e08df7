"""What a checkpoint holds, gathered from a running trainer and given back to one.

Schema of a checkpoint (format 3; ``torch.load(weights_only=True)`` reads every entry)::

    format       int
    model        the unwrapped model's state_dict (no "module." prefixes); with the ema
                 callback, the averaged weights (what was validated)
    raw_model    with the ema callback only: the trained (not averaged) weights
    ema          with the ema callback only: {"decay", "updates"}
    optimizer    optimizer.state_dict()
    scheduler    scheduler.state_dict() or None
    scaler       GradScaler.state_dict() or None
    epoch        the epoch a resume starts in (0-based)
    batch        batches of that epoch already done (0 = at the epoch's start)
    step         optimizer steps done in all
    best         {"metric": name, "value": best value or None, "epoch": int or None}
    metrics      the latest validation metrics, e.g. {"val/loss": .., "val/acc": ..}
    history      [{epoch, step, val/...}, ...] of every validation so far
    callbacks    {name: the callback's state_dict()}, e.g. callbacks/checkpoint's top-k
                 ranking, callbacks/early_stopping's counter; numpy arrays and scalars in
                 it as tagged tensors (:mod:`ddpexp.checkpoint.portable`)
    loggers      {name: the logger's state_dict() at its last acknowledged step}, e.g. the
                 MLflow run id
    logger_queues {name: {"acked_step": the last step the logger stored, "pending": the
                 points queued after it, [[step, epoch, {name: value}], ...], sent again
                 on resume, "lost": {"points", "steps"} it never stored}}
    ranks        one entry per rank: {"rng": generator states (torch, cuda, numpy, python),
                 "train_accum": {"names", "sums", "seen"} not yet logged}
    world_size   the world size that wrote it (``ranks`` has one entry per rank)
    global_batch samples per micro-batch over all replicas (data.batch_size x the
                 data-parallel size, which is the world size without model parallelism),
                 so that ``batch`` converts to another world size or batch size
    config       the resolved config of the run, plain Python

Under ``strategy=fsdp`` ``last.pt`` is a sharded directory (:mod:`ddpexp.checkpoint.sharded`) whose
``model``, ``raw_model`` and ``optimizer`` (keyed by parameter name) are each rank's shards,
the rest in its ``meta.pt``; its best.pt and top-k files are single files with the whole
``model`` and every entry above but ``optimizer`` and ``raw_model``.

Format 2 (before callbacks) kept the top-k ranking under ``top_k`` and the early-stopping
counter under ``early_stop``; it still resumes.

``epoch``, ``batch``, ``step``, ``best``, ``metrics`` and ``history`` are the trainer's
:class:`~ddpexp.callbacks.state.RunState` (its ``state_dict()``, given back by its
``load_state_dict()``); this module reads no counter off the trainer and sets none on it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from ddpexp.callbacks.base import Dispatch, TrainerView
from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io as ckpt_io
from ddpexp.checkpoint import portable
from ddpexp.checkpoint import sharded as ckpt_sharded
from ddpexp.config.resume import value_at
from ddpexp.errors import CheckpointError, ConfigError
from ddpexp.runtime.dist import DistContext, rng_state, set_rng_state

if TYPE_CHECKING:
    from ddpexp.data.base import DataSource
    from ddpexp.strategies.base import Strategy
    from ddpexp.training.meters import RunningMeans

log = logging.getLogger("ddpexp")

FORMAT = 3


class Checkpointable(TrainerView, Protocol):
    """What the schema reads of the trainer (:class:`ddpexp.training.trainer.Trainer`)
    beyond what callbacks see. A protocol, not the trainer's class: the trainer imports this
    module, and this one states what it needs instead of importing the trainer."""

    strategy: Strategy
    scheduler: Any | None  # an lr scheduler: state_dict() / load_state_dict()
    scaler: torch.amp.GradScaler
    train_means: RunningMeans
    callbacks: Dispatch
    data: DataSource
    config: dict
    ctx: DistContext
    seed: int
    train_sampler: Any  # the ResumableDistributedSampler of the training split


def gather(trainer: Checkpointable) -> dict | None:
    """The checkpoint of ``trainer`` as it is now. Every rank must call it (it gathers each
    rank's random state); global rank 0 gets the dict, the others ``None``; under a sharded
    strategy (fsdp) every rank gets it, ``"model"`` and ``"optimizer"`` holding its shards."""
    mine = {"rng": rng_state(), "train_accum": trainer.train_means.state_dict()}
    ranks = [mine]
    if trainer.world_size > 1:
        ranks: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(ranks, mine)
    strategy = trainer.strategy
    if not trainer.is_main and not strategy.sharded:
        return None
    state = {
        "format": FORMAT,
        "model": strategy.model_state(trainer.module),
        "optimizer": strategy.optimizer_state(trainer.module, trainer.optimizer),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "scaler": trainer.scaler.state_dict() if trainer.scaler.is_enabled() else None,
        **trainer.state.state_dict(),  # epoch, batch, step, best, metrics, history
        "callbacks": {name: portable.encode(cb.state_dict(), f"callbacks.{name}")
                      for name, cb in trainer.callbacks},
        **trainer.loggers.state_dict(),  # loggers, logger_queues
        "ranks": ranks,
        "world_size": trainer.world_size,
        "layout": layout(trainer),
        # Samples per micro-batch over all replicas: where "batch" is in the epoch at another
        # world size or batch size.
        "global_batch": trainer.data.batch_size * trainer.strategy.dp_size,
        "data": data_position(trainer),
        "config": trainer.config,
    }
    trainer.callbacks.fire("on_save_checkpoint", trainer, state)
    return state


def data_position(trainer: Checkpointable) -> dict:
    """Where the data stream is: the epoch, the samples of it all ranks have trained on, the
    shuffle's seed and the training split's size; the epoch's order is a function of the
    seed and the epoch alone (:class:`ddpexp.data.base.ResumableDistributedSampler`)."""
    per_batch = trainer.data.batch_size * trainer.strategy.dp_size
    return {"epoch": trainer.epoch, "samples": trainer.batch * per_batch, "seed": trainer.seed,
            "split_samples": len(trainer.train_sampler.dataset)}


def layout(trainer: Checkpointable) -> dict:
    """How ``trainer``'s model is laid out over its ranks, as a checkpoint records it."""
    return {"strategy": trainer.strategy.label(), "dp": trainer.strategy.dp_size,
            "tp": trainer.world_size // trainer.strategy.dp_size}


def describe_layout(saved: Mapping[str, Any]) -> str:
    """A :func:`layout` as the resume's line names it: "strategy=fsdp dp=2 x tp=2"."""
    return f"strategy={saved.get('strategy')} dp={saved.get('dp')} x tp={saved.get('tp')}"


def load(trainer: Checkpointable, path: Path, changes: Sequence[Mapping[str, Any]] = ()) -> list[dict]:
    """Resume ``trainer`` from the checkpoint at ``path``, a file or a sharded directory
    written at any world size (every rank reads it), with the config ``changes`` that the
    run's parent let through applied (see :func:`restore`); returns those applied."""
    sharded = ckpt_sharded.is_sharded(path)
    if sharded and trainer.ctx.restart > 0:
        _check_shards(trainer, path)
    if sharded:
        from ddpexp.checkpoint.sharded import sharded_shapes

        state = None
        saved = {k: torch.empty(shape, device="meta")
                 for k, shape in sharded_shapes(path).get("model", {}).items()}
    else:
        state = ckpt_io.load(path, map_location=trainer.device)
        saved = state["model"]
    differs = model_difference(trainer.module.state_dict(), saved)
    if differs:
        raise ConfigError(
            f"checkpoint {path} does not fit this run's model: {differs}. Resume with the "
            "model config the run was started with (its .hydra/config.yaml)"
        )
    strategy = trainer.strategy
    if sharded:
        state = strategy.read_sharded(trainer.module, trainer.optimizer, path)
    else:  # the file read above
        state = strategy.from_file(trainer.module, trainer.optimizer, cast(dict, state))
    saved_layout, here = state.get("layout"), layout(trainer)
    if saved_layout is not None and saved_layout != here and trainer.is_main:
        log.info("resharded: the checkpoint was written at %s, this run is %s",
                 describe_layout(saved_layout), describe_layout(here))
    if "optimizer" not in state:
        raise ConfigError(
            f"checkpoint {path} holds the weights only (best.pt and the top-k files of an fsdp "
            f"run); resume from its run's checkpoints/{ckpt_files.LAST}, or evaluate it with "
            "python -m ddpexp.eval")
    try:
        return restore(trainer, state, changes)
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        text = " ".join(str(exc).split())
        raise ConfigError(
            f"checkpoint {path} does not fit this run's model/optimizer ({text[:300]}); "
            "resume with the config the run was started with"
        ) from None


def _check_shards(trainer: Checkpointable, path: Path) -> None:
    """Refuse, on every rank, a sharded checkpoint whose files are not the bytes saved. The
    checkpoint a run starts from was checked before its workers started; the one a restart
    of the workers continues from was written since, and is checked here, by global rank 0
    alone (each rank reads only its shards), its verdict shared."""
    problem: list[str | None] = [None]
    if trainer.is_main:
        try:
            ckpt_files.check_digest(path)
        except CheckpointError as exc:
            problem = [str(exc)]
    if trainer.world_size > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])


def restore(trainer: Checkpointable, state: dict, changes: Sequence[Mapping[str, Any]] = ()) -> list[dict]:
    """Give ``trainer`` what :func:`gather` saved. Random states and unlogged training sums
    are restored only when the world size is the same (else the run is not bit-exact, and a
    warning says so). ``changes`` (``{"key", "from", "to"}``, :mod:`ddpexp.config.resume`)
    are then applied from the checkpoint's step (:func:`_apply_changes`); returns those
    applied, each with its ``step``."""
    t, is_main = trainer, trainer.is_main
    fresh = _Fresh.of(t)  # what this run's config built, before the checkpoint overwrites it
    t.callbacks.fire("on_load_checkpoint", t, state)
    if "raw_model" in state:  # an average that no callback took: continue the trained weights
        if is_main:
            log.warning("the checkpoint holds an average of the weights (trainer.ema_decay=%s), "
                        "this run has none: it continues the trained weights", state["ema"]["decay"])
        state["model"] = state.pop("raw_model")
    t.module.load_state_dict(state["model"])
    t.strategy.load_optimizer(t.module, t.optimizer, state["optimizer"])
    if t.scheduler is not None and state.get("scheduler") is not None:
        t.scheduler.load_state_dict(_schedule_progress(state["scheduler"], fresh.schedule))
    if state.get("scaler") is not None and t.scaler.is_enabled():
        t.scaler.load_state_dict(state["scaler"])
    batch = _batch_here(state, t.data.batch_size * t.strategy.dp_size, is_main)
    _check_split(state.get("data"), len(t.train_sampler.dataset), batch, is_main)
    t.state.load_state_dict({**state, "batch": batch})
    _hand_out("callbacks", dict(t.callbacks), callback_states(state), is_main)
    t.loggers.load_state_dict(state)
    ranks = state["ranks"]
    if state["world_size"] == t.world_size and len(ranks) == t.world_size:
        mine = ranks[t.rank]
        set_rng_state(mine["rng"])
        t.train_means.load_state_dict(mine["train_accum"])
    elif is_main:
        log.warning("checkpoint written by %d workers, resumed on %d: random streams start "
                    "afresh, so the run is not bit-identical to an uninterrupted one",
                    state["world_size"], t.world_size)
    return _apply_changes(t, state, changes, fresh)


def _check_split(saved: Mapping[str, Any] | None, samples: int, batch: int, is_main: bool) -> None:
    """One warning where the training split is not the size it was when the checkpoint was
    written (files added or taken away under the same config): the epoch's order is then
    another, and the rest of it not the samples the run had left."""
    if not saved or saved.get("split_samples") in (None, samples) or not is_main:
        return
    log.warning("the training split has %d samples, the checkpoint's run had %d: the data "
                "changed, so the rest of epoch %d is another order%s", samples,
                saved["split_samples"], saved["epoch"],
                ", and some samples of it may be seen twice or not at all" if batch else "")


def _batch_here(state: dict, global_batch: int, is_main: bool) -> int:
    """The checkpoint's position in its epoch in this run's micro-batches: the same number
    of samples seen over all ranks, so that a run resumed at another world size with the
    same global batch continues at the same sample."""
    saved = state.get("global_batch")
    if saved is None:
        config = state.get("config") or {}
        # (written before global_batch, by data parallelism alone: dp = world size)
        saved = (config.get("data") or {}).get("batch_size", 0) * state.get("world_size", 1)
    if not saved or saved == global_batch or not state["batch"]:
        return state["batch"]
    samples = state["batch"] * saved
    if samples % global_batch and is_main:
        log.warning("the checkpoint is %d samples into epoch %d, not a whole number of this run's "
                    "%d-sample micro-batches: the epoch continues at the micro-batch before",
                    samples, state["epoch"], global_batch)
    return samples // global_batch


def callback_states(ckpt: Mapping[str, Any]) -> dict:
    """The callbacks' states of checkpoint ``ckpt`` by name (format 2 included), numpy
    arrays and scalars as they were saved (:mod:`ddpexp.checkpoint.portable`)."""
    if "callbacks" in ckpt:
        return {name: portable.decode(s) for name, s in (ckpt["callbacks"] or {}).items()}
    return {"checkpoint": {"top_k": ckpt.get("top_k")},
            "early_stopping": {"best": (ckpt.get("best") or {}).get("value"),
                               "bad_epochs": int(ckpt.get("early_stop", 0))}}


def _hand_out(group: str, parts: Mapping[str, Any], saved: Mapping[str, Any], is_main: bool) -> None:
    """Each part gets its saved state; one warning line for a part without saved state, one
    for saved state without its part."""
    for name, part in parts.items():
        if name in saved:
            part.load_state_dict(saved[name])
        elif is_main:
            log.warning("%s.%s has no state in the checkpoint: it starts afresh", group, name)
    extra = [name for name in saved if name not in parts]
    if extra and is_main:
        log.warning("the checkpoint holds the state of %s %s, which this run does not have: "
                    "ignored", group, ", ".join(extra))


def model_difference(mine: Mapping[str, torch.Tensor], saved: Mapping[str, Any], show: int = 4) -> str:
    """How a checkpoint's weights differ from the model's: keys only one side has and
    tensors of other shapes (a few of each), or "" when they fit."""
    def some(names: list[str]) -> str:
        return ", ".join(names[:show]) + (f" and {len(names) - show} more" if len(names) > show else "")

    parts = []
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    shapes = [f"{k} {list(saved[k].shape)} in the checkpoint vs {list(v.shape)} here"
              for k, v in mine.items()
              if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
    if missing:
        parts.append(f"the checkpoint lacks {some(missing)}")
    if extra:
        parts.append(f"the model has no {some(extra)}")
    if shapes:
        parts.append("shapes differ: " + some(shapes))
    return "; ".join(parts)


def _schedule_progress(state: dict, fresh: dict | None) -> dict:
    """A scheduler state whose shape (total steps, warm-up: LambdaLR's lr multipliers,
    OneCycleLR's phases) comes from this run's config, only its progress from the
    checkpoint. Otherwise a run first stopped by a smaller max_steps/max_epochs would keep
    that run's length after ``resume=`` extends it."""
    state = {**state, **{k: fresh[k] for k in _SCHEDULE_SHAPE if fresh and k in fresh and k in state}}
    if "lr_lambdas" not in state:
        return state
    return {**state, "lr_lambdas": [None] * len(state["lr_lambdas"])}


# Scheduler attributes made from the config, not from the steps taken (OneCycleLR's).
_SCHEDULE_SHAPE = ("total_steps", "_schedule_phases")
# Param-group entries that schedulers add from the config (the lr a schedule starts from,
# OneCycleLR's bounds and momentum range).
_SCHEDULE_GROUP_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})


@dataclass(frozen=True)
class _Fresh:
    """What this run's config built before a checkpoint was loaded over it: each param
    group's hyperparameters and the scheduler's state."""

    groups: list[dict]
    schedule: dict | None

    @classmethod
    def of(cls, trainer: Checkpointable) -> _Fresh:
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in trainer.optimizer.param_groups]
        schedule = trainer.scheduler.state_dict() if trainer.scheduler is not None else None
        return cls(groups, schedule)


def _apply_changes(t: Checkpointable, state: dict, changes: Sequence[Mapping[str, Any]],
                   fresh: _Fresh) -> list[dict]:
    """Apply ``changes`` to the restored trainer from the checkpoint's step. Optimizer
    values are written into every param group; with a schedule, its base values become the
    new ones and the current lr (and OneCycleLR's momentum) is the schedule's at its step
    with them: ``optimizer.lr=0.5`` under a cosine schedule halfway through gives
    0.5 x the cosine factor there. Other keys act through the config the trainer was built
    from. A change already in the checkpoint's config (a restart of this resume's workers
    from a checkpoint it wrote) is not applied again."""
    saved = state.get("config") or {}
    pending = [dict(c) for c in changes if value_at(saved, c["key"]) != c["to"]]
    if not pending:
        return []
    keys = [c["key"] for c in pending]
    names = {k.split(".", 1)[1] for k in keys if k.startswith("optimizer.")}
    schedule_changed = bool(names) or any(k.startswith("scheduler.") for k in keys)
    for group, new in zip(t.optimizer.param_groups, fresh.groups, strict=False):
        for name in new.keys() & (names | (_SCHEDULE_GROUP_KEYS if schedule_changed else set())):
            group[name] = copy.deepcopy(new[name])
    if t.scheduler is not None:
        if schedule_changed and fresh.schedule is not None and "base_lrs" in fresh.schedule:
            t.scheduler.base_lrs = list(fresh.schedule["base_lrs"])
        _reschedule(t.scheduler, t.optimizer)
    return [{**c, "step": t.state.step} for c in pending]


def _reschedule(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Set each param group's lr to what ``scheduler`` gives at its step (closed form: the
    built-in schedules' LambdaLR and OneCycleLR, or a scheduler's ``_get_closed_form_lr``);
    a schedule that only knows its next lr from the current one is left as it is."""
    from torch.optim.lr_scheduler import LambdaLR, OneCycleLR

    if hasattr(scheduler, "_get_closed_form_lr"):
        lrs = scheduler._get_closed_form_lr()
    elif isinstance(scheduler, (LambdaLR, OneCycleLR)):
        within = getattr(scheduler, "_get_lr_called_within_step", False)
        scheduler._get_lr_called_within_step = True  # asked on purpose: no warning
        try:
            lrs = scheduler.get_lr()
        finally:
            scheduler._get_lr_called_within_step = within
    else:
        return
    for group, lr in zip(optimizer.param_groups, lrs, strict=False):
        group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
