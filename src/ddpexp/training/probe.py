"""Checks of the task, model and data on a few real samples before the first step, so that
parts that do not fit together fail in seconds with a message instead of after an epoch.

What the checks find (the validation metric names, the memory format the model keeps, the
loss of the initial weights) comes back as a :class:`Probed` for the trainer to store; the
checks read the trainer and set nothing on it."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sized
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ddpexp import models
from ddpexp.callbacks.base import TrainerView
from ddpexp.errors import ConfigError
from ddpexp.strategies.registry import label, strategy_class
from ddpexp.training import loaders
from ddpexp.training.meters import metric_names

if TYPE_CHECKING:
    from ddpexp.config.schema import TrainerConfig
    from ddpexp.data.base import ResumableDistributedSampler
    from ddpexp.task import Task
    from ddpexp.training.split_metrics import SplitMetrics

log = logging.getLogger("ddpexp")

# Training samples run through the task's checks before the first step.
PROBE_SAMPLES = 64


class Probeable(TrainerView, Protocol):
    """What the checks read of the trainer (:class:`ddpexp.training.trainer.Trainer`)
    beyond what callbacks see. A protocol, not the trainer's class: the trainer imports this
    module, and this one states what it needs instead of importing the trainer."""

    t: TrainerConfig
    task: Task
    val_ds: Dataset
    train_sampler: ResumableDistributedSampler
    split_metrics: SplitMetrics

    def autocast(self) -> AbstractContextManager[Any]:
        """The precision's autocast context."""
        ...


@dataclass(frozen=True)
class Probed:
    """What :func:`check_task` found: the task's validation metric names (without
    ``val/``), the memory format the model ended in (``torch.preserve_format`` where
    channels_last fell back) and the training loss of the initial weights on the probe batch
    (where ``trainer.divergence_factor`` measures from)."""

    val_names: list[str]
    memory_format: torch.memory_format
    start_loss: float


def check_task(trainer: Probeable, layout: torch.memory_format, on_trial: bool) -> Probed:
    """Run the task's checks and one training step's forward on a batch of training samples,
    then its validation step on two validation samples, with the model in memory format ``layout``
    (``on_trial``: channels_last that the probe batch must confirm, see
    :func:`memory_format`). A ``trainer.monitor`` the task does not return is refused here."""
    if len(cast(Sized, trainer.val_ds)) == 0:
        raise ConfigError("the validation split is empty; give the data a larger val share")
    layout, start_loss = check_batch(trainer, layout, on_trial)
    samples = default_collate([trainer.val_ds[i] for i in range(min(2, len(cast(Sized, trainer.val_ds))))])
    probe = loaders.to_device(samples, trainer.device, layout)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), trainer.autocast():
        trainer.module.eval()
        out = trainer.task.validation_step(trainer.module, probe)
    task = type(trainer.task).__name__
    names = metric_names(out, task, "validation_step")
    returned = [f"val/{n}" for n in names] + [f"val/{n}" for n in trainer.task.derived(
        {n: float(out[n]) for n in names})]
    returned += check_split_metrics(trainer, out, probe, returned)
    if trainer.monitor not in returned:
        raise ConfigError(
            f"trainer.monitor={trainer.monitor} is not a metric of the task ({task}); "
            f"it returns {', '.join(returned)}"
        )
    return Probed(names, layout, start_loss)


def check_split_metrics(trainer: Probeable, out: Mapping[str, Any], batch: Any,
                        returned: list[str]) -> list[str]:
    """Feed the probe batch to the task's metric objects (then reset them), so that a
    validation step and an ``update_metrics`` that do not fit fail here; return their
    ``val/<name>``."""
    whole = trainer.split_metrics
    if not whole:
        return []
    task = type(trainer.task).__name__
    clash = [n for n in whole.names if f"val/{n}" in returned]
    if clash:
        raise ConfigError(f"task {task}: split_metrics() and validation_step both name "
                          f"{', '.join(clash)}; give each metric one name")
    try:
        whole.update(out, batch)
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as exc:
        raise ConfigError(
            f"task {task}: its metric objects cannot take a validation batch: {first_line(exc)}. "
            "validation_step returns what they need under \"outputs\", and update_metrics("
            "metrics, outputs, batch) feeds them (by default update(outputs, target))"
        ) from exc
    finally:
        whole.reset()
    return [f"val/{n}" for n in whole.names]


def check_batch(trainer: Probeable, layout: torch.memory_format,
                on_trial: bool) -> tuple[torch.memory_format, float]:
    """The task's own checks and a training step's forward on a batch of the first training
    samples, before the first step; returns the memory format the model keeps and the step's
    loss (where trainer.divergence_factor measures from). A model ``on_trial`` in
    channels_last that fails in it but not in its own layout falls back to that layout
    (trainer.channels_last=null, one warning) or is refused (=true, naming the key)."""
    dataset = trainer.train_sampler.dataset
    batch = default_collate([dataset[i] for i in range(min(PROBE_SAMPLES, len(cast(Sized, dataset))))])
    failure = None
    try:
        out = _probe(trainer, batch, layout)
    except Exception as exc:
        if not on_trial:
            raise
        failure = exc
    if failure is not None:  # outside the handler: a second failure is told on its own
        layout = torch.preserve_format
        out = _without_channels_last(trainer, batch, failure)
    metric_names(out, type(trainer.task).__name__, "training_step")
    return layout, float(out["loss"])


def _without_channels_last(trainer: Probeable, batch: Any, failure: Exception) -> Mapping[str, torch.Tensor]:
    """The probe again in the model's own layout, after ``failure`` in channels_last: the
    model's own error if it fails again, else the layout falls back (null) or the run is
    refused (trainer.channels_last=true)."""
    trainer.module.to(memory_format=torch.contiguous_format)
    out = _probe(trainer, batch, torch.preserve_format)
    reason = first_line(failure.__cause__ or failure)
    name = type(trainer.module).__name__
    if trainer.t.channels_last:
        raise ConfigError(
            f"the model ({name}) fails on channels_last tensors ({reason}), which "
            "trainer.channels_last=true asks for; it works without. Set "
            "trainer.channels_last=false (or null), or reshape with x.reshape/x.flatten(1) "
            "instead of x.view in its forward"
        ) from failure
    if trainer.is_main:
        log.warning("the model (%s) fails on channels_last tensors (%s): trained in its own "
                    "memory format instead. trainer.channels_last=false skips this trial; "
                    "with x.reshape/x.flatten(1) instead of x.view in its forward, "
                    "trainer.channels_last=true gives the faster layout", name, reason)
    return out


def _probe(trainer: Probeable, batch: Any, layout: torch.memory_format) -> Any:
    """The task's check and training step of ``batch`` (in memory format ``layout``) with the
    initial weights, off the record (no grad, eval mode, the random streams restored);
    returns the step's metrics. An error of the model keeps its cause, so that
    HYDRA_FULL_ERROR=1 shows its line."""
    with torch.random.fork_rng(devices=[]), torch.no_grad(), trainer.autocast():
        probe = loaders.to_device(batch, trainer.device, layout)
        trainer.module.eval()
        try:
            trainer.task.check(trainer.module, probe)
            return trainer.task.training_step(trainer.module, probe)
        except (RuntimeError, IndexError) as exc:
            raise ConfigError(
                f"the model ({type(trainer.module).__name__}) cannot take a batch of the data "
                f"with task {type(trainer.task).__name__}: {first_line(exc)}. Check that "
                "data.shape and data.num_classes match the data, and the model's keys match both"
            ) from exc


def check_sample_shape(data_cfg: dict, train: Dataset) -> None:
    """``data.shape`` is what the models read their input size from: it must be the shape
    of the data's samples (where a sample is an (input tensor, target) pair)."""
    shape = data_cfg.get("shape")
    if not isinstance(shape, (list, tuple)) or len(cast(Sized, train)) == 0:
        return
    sample = train[0]
    if not (isinstance(sample, (tuple, list)) and sample and isinstance(sample[0], torch.Tensor)):
        return
    actual = list(sample[0].shape)
    if actual != list(shape):
        raise ConfigError(
            f"data.shape={list(shape)} but the samples of data {data_cfg.get('_target_')} have "
            f"shape {actual}; set data.shape={actual} (the models read their input size from it)"
        )


def memory_format(model: nn.Module, t: Any, device: torch.device) -> tuple[torch.memory_format, bool]:
    """The model's memory format for ``trainer.channels_last`` and whether the probe batch
    must confirm it: where the default chose channels_last for a model not known to take it,
    and where it was asked for (so that a model it breaks is told which key to change)."""
    channels_last = t.channels_last
    if not strategy_class(t.strategy).channels_last:
        if channels_last:
            raise ConfigError(f"trainer.channels_last=true with trainer.strategy={label(t.strategy)}: "
                              "its parameters must stay contiguous; leave trainer.channels_last unset")
        channels_last = False  # e.g. FSDP2 refuses channels_last (non-contiguous) parameters
    if channels_last is None:
        channels_last = channels_last_pays(model, device, str(t.precision))
    on_trial = bool(channels_last) and (t.channels_last is True or not models.channels_last_safe(model))
    return (torch.channels_last if channels_last else torch.preserve_format), on_trial


def channels_last_pays(model: nn.Module, device: torch.device, precision: str) -> bool:
    """``trainer.channels_last=null``: channels_last where it was measured faster. On the CPU
    oneDNN's convolutions, batch norm and pooling run 1.2-1.9x faster on channels_last
    tensors (docs/benchmarks.md); on a GPU it pays with tensor-core precisions (bf16, 16).
    Only models with 2-d convolutions have anything to gain; for others (an MLP on images)
    reordering each batch would be a copy for nothing."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return False
    return device.type == "cpu" or precision in ("bf16", "16")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
