"""What a training step computes: the ``task`` config group and its contract.

The trainer knows no task. It moves each batch to the device, calls
:meth:`Task.training_step` (or :meth:`Task.validation_step`) and back-propagates the
``"loss"`` it returns; every name the task returns is logged as ``train/<name>`` and
``val/<name>``. A task is a plain class named by ``task._target_``::

    class MyTask(ddpexp.Task):
        monitor, monitor_mode = "val/mae", "min"     # defaults of trainer.monitor/_mode

        def training_step(self, model, batch):
            out = model(batch["x"])
            loss = F.mse_loss(out, batch["y"])
            return {"loss": loss, "mae": (out - batch["y"]).abs().mean()}

The contract, in one place:

- ``training_step(model, batch) -> dict[str, Tensor]``: scalar tensors, each the **mean over
  the batch's samples**; ``"loss"`` is required and is what is back-propagated. ``model`` is
  the (DDP-wrapped, possibly compiled) model to call. Beside the means, the dict may hold
  an ``"outputs"`` entry of any kind, never logged: what :meth:`Task.update_metrics` reads.
- ``validation_step(model, batch)``: optional, the same convention; by default
  ``training_step`` (the trainer runs it under ``torch.no_grad`` with the model in eval mode).
- ``batch_size(batch) -> int``: optional; by default the length of the first tensor found in
  the batch (any nesting of tuples, lists and dicts).
- ``derived(means) -> dict[str, float]``: optional; metrics computed from the aggregated
  means, such as a perplexity from the mean loss.
- ``monitor`` / ``monitor_mode``: optional class attributes.
- ``split_metrics() -> dict[str, Metric]``: optional; fresh metric objects (torchmetrics
  ``Metric`` objects, or anything with ``update``/``compute``/``reset``) for what is not a mean over
  samples (an F1, an AUROC, an R2). Each is logged as ``val/<name>`` and ``test/<name>``,
  counted over the whole split whatever the number of ranks: the trainer keeps them on the
  device, updates them batch by batch and computes them once per evaluation on every rank
  (torchmetrics gathers the ranks' states then), then resets them.
- ``update_metrics(metrics, outputs, batch)``: optional; feeds one validation batch to the
  metric objects. ``outputs`` is what ``validation_step`` returned under the key
  ``"outputs"`` (the predictions, say: anything; never logged), so no second forward pass is
  needed. By default each metric gets ``update(outputs, target)`` for batches ``(inputs,
  target)``.
- ``check(model, batch)``: optional; called once on a batch of training samples before the
  first step, to turn a mistake (labels out of range, say) into a :class:`ConfigError`
  naming the key to fix, where the step itself would fail obscurely later. It may compare
  values on the host: it is off the hot path.

Only ``training_step`` is required, whether or not the class derives from :class:`Task`:
:func:`as_task` gives an object of any other class the defaults above for what it leaves out.

Because each returned value is a per-sample mean, the trainer weights it by
``batch_size(batch)``: gradient accumulation, uneven last batches and validation sharded over
any number of ranks then give exactly the numbers one big batch would.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ddpexp.config.lists import as_list
from ddpexp.config.monitor import DEFAULT_MONITOR, DEFAULT_MONITOR_MODE
from ddpexp.errors import ConfigError


class Task:
    """Base class of the tasks; subclasses implement :meth:`training_step`."""

    monitor: str = DEFAULT_MONITOR
    monitor_mode: str = DEFAULT_MONITOR_MODE

    def training_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Forward one batch; return scalar per-sample means, ``"loss"`` among them."""
        raise NotImplementedError

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Metrics of one validation (or test) batch; by default :meth:`training_step`."""
        return self.training_step(model, batch)

    def batch_size(self, batch: Any) -> int:
        """Samples in ``batch``: the length of its first tensor."""
        first = first_tensor(batch)
        if first is None:
            raise ConfigError(
                f"task {type(self).__name__}: a batch holds no tensor, so its size is unknown; "
                "define batch_size(batch) on the task"
            )
        return len(first)

    def derived(self, means: Mapping[str, float]) -> dict[str, float]:
        """Metrics computed from the aggregated means (none by default)."""
        return {}

    def check(self, model: nn.Module, batch: Any) -> None:
        """Checks of one batch of training samples before the first step (none by default)."""

    def split_metrics(self) -> dict[str, Any]:
        """Fresh metric objects over a whole split, by name (none by default)."""
        return {}

    def update_metrics(self, metrics: Mapping[str, Any], outputs: Any, batch: Any) -> None:
        """Feed one batch to ``metrics``: ``update(outputs, target)`` of batches ``(inputs,
        target)``; ``outputs`` is the ``"outputs"`` entry of :meth:`validation_step`."""
        _, target = _pair(batch, type(self).__name__)
        for metric in metrics.values():
            metric.update(outputs, target)


# What a task may leave out; Task's own definitions are the defaults.
_OPTIONAL_METHODS = ("validation_step", "batch_size", "derived", "check", "split_metrics",
                     "update_metrics")
_OPTIONAL_ATTRIBUTES = ("monitor", "monitor_mode")


def as_task(task: Any) -> Task:
    """``task`` with the whole :class:`Task` interface: a ``Task`` as it is; an object of any
    other class (the contract asks only for ``training_step``) wrapped so that what it does
    not define gets ``Task``'s default, and what it does define is its own. Everything
    else (``trainer.task.foo``) still reaches the object."""
    if isinstance(task, Task):
        return task
    if not callable(getattr(task, "training_step", None)):
        raise ConfigError(
            f"task._target_ built a {type(task).__name__} without a training_step(model, batch) "
            "method; a task needs one (returning a dict of scalar tensors with a 'loss' entry)"
        )
    return _adapter_class(type(task))(task)


class _PlainTask(Task):
    """A task object of a class that does not derive from Task, seen through Task."""

    def __init__(self, task: Any):
        self._task = task
        for name in ("training_step", *_OPTIONAL_METHODS):
            method = getattr(task, name, None)
            if callable(method):
                setattr(self, name, method)
        for name in _OPTIONAL_ATTRIBUTES:
            if hasattr(task, name):
                setattr(self, name, getattr(task, name))

    def __getattr__(self, name: str) -> Any:  # only what the wrapper itself lacks
        if name == "_task":
            raise AttributeError(name)
        return getattr(self._task, name)


@functools.cache
def _adapter_class(cls: type) -> type:
    """A :class:`_PlainTask` named after ``cls``, so that messages name the user's class."""
    return type(cls.__name__, (_PlainTask,), {"__qualname__": cls.__qualname__,
                                              "__module__": cls.__module__})


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor in a nesting of tuples, lists and dicts (dicts in insertion order)."""
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def _pair(batch: Any, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(
            f"task={task} expects batches (inputs, targets); got {type(batch).__name__}. "
            "Use a data option that yields pairs, or a task of your own (task._target_)"
        )
    return batch[0], batch[1]


def _output(out: Any, task: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"task={task}: the model returned {type(out).__name__}, not a tensor. Its forward "
            "must return the predictions as one tensor (or write a task of your own)"
        )
    return out


# task.metrics of task=classification: over the whole split, macro-averaged over the classes.
CLASSIFICATION_METRICS = ("f1", "auroc")


class Classification(Task):
    """Cross-entropy over class logits; reports ``loss`` and ``acc``, and the metrics over the
    whole split that ``metrics`` names (``f1``: macro F1; ``auroc``: macro one-vs-rest AUROC,
    exact, or binned at ``thresholds`` thresholds)."""

    monitor = "val/acc"
    monitor_mode = "max"

    def __init__(self, metrics: Sequence[str] = (), num_classes: int | None = None,
                 thresholds: int | None = None):
        metrics = as_list(metrics)  # task.metrics=f1 is [f1]
        unknown = [m for m in metrics if m not in CLASSIFICATION_METRICS]
        if unknown:
            raise ConfigError(
                f"task.metrics: {', '.join(map(str, unknown))} "
                f"{'is' if len(unknown) == 1 else 'are'} not a metric of task=classification; "
                f"the known ones are {', '.join(CLASSIFICATION_METRICS)}"
            )
        if metrics and (num_classes is None or num_classes < 2):
            raise ConfigError(f"task.metrics needs task.num_classes >= 2 (got {num_classes}); "
                              "set data.num_classes")
        if thresholds is not None and (isinstance(thresholds, bool) or int(thresholds) < 2):
            raise ConfigError(f"task.thresholds={thresholds!r}: null (exact AUROC) or an "
                              "integer >= 2 (binned AUROC)")
        self.metric_names = list(dict.fromkeys(metrics))
        self.num_classes, self.thresholds = num_classes, thresholds

    def split_metrics(self) -> dict[str, Any]:
        if not self.metric_names:
            return {}  # torchmetrics costs a second of import: only when a metric is asked
        from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

        classes = cast(int, self.num_classes)  # __init__ refuses metrics without it
        # validate_args=False: the checks compare values on the host, a sync per batch.
        build = {
            "f1": lambda: MulticlassF1Score(classes, average="macro", validate_args=False),
            "auroc": lambda: MulticlassAUROC(classes, average="macro",
                                             thresholds=self.thresholds, validate_args=False),
        }
        return {name: build[name]() for name in self.metric_names}

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = _pair(batch, "classification")
        logits = _output(model(x), "classification").float()
        out = self._metrics_of(logits, y)
        if self.metric_names:
            out["outputs"] = logits.softmax(-1)  # probabilities, as the AUROC reads them
        return out

    def training_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = _pair(batch, "classification")
        return self._metrics_of(_output(model(x), "classification").float(), y)

    @staticmethod
    def _metrics_of(logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(logits, y)
        # float64: k/n exact to 1e-16, so that summing n * acc over batches recounts k.
        acc = (logits.detach().argmax(1) == y).double().mean()
        return {"loss": loss, "acc": acc}

    def check(self, model: nn.Module, batch: Any) -> None:
        """Integer labels within the classes the model outputs."""
        x, y = _pair(batch, "classification")
        if y.is_floating_point() or y.is_complex():
            raise ConfigError(
                f"task=classification needs integer class labels, but the data gives {y.dtype} "
                "labels. For real-valued targets use task=regression; for classes, have the "
                "dataset return labels as integers (torch.long)"
            )
        classes = _output(model(x), "classification").shape[-1]
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= classes:
            raise ConfigError(
                f"task=classification: the data has labels from {low} to {high}, but the model "
                f"outputs {classes} classes (data.num_classes). Set data.num_classes="
                f"{max(high + 1, classes)} (labels must lie in 0..num_classes-1)"
            )


class Regression(Task):
    """Mean squared error; reports ``loss`` (= ``mse``), ``mse`` and ``mae``."""

    monitor = "val/mse"
    monitor_mode = "min"

    def training_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = _pair(batch, "regression")
        pred = _output(model(x), "regression").float()
        y = y.float()
        if pred.shape != y.shape and pred.dim() == y.dim() + 1 and pred.shape[-1] == 1:
            pred = pred.squeeze(-1)  # one output per sample against a vector of targets
        if pred.shape != y.shape:
            raise ConfigError(
                f"task=regression: the model predicts {list(pred.shape)} for targets of shape "
                f"{list(y.shape)}; give the model one output per target (model.num_classes)"
            )
        err = pred - y
        per_sample = err.pow(2).flatten(1).mean(1) if err.dim() > 1 else err.pow(2)
        mse = per_sample.mean()
        mae = err.detach().abs().mean()
        return {"loss": mse, "mse": mse.detach(), "mae": mae}


class LanguageModel(Task):
    """Next-token prediction: ``batch`` is ``(tokens, next tokens)``, the model returns logits
    of shape (batch, time, vocabulary). Reports ``loss`` (mean per token), ``acc`` (token
    accuracy) and ``ppl`` (the perplexity, ``exp`` of the mean loss)."""

    monitor = "val/loss"
    monitor_mode = "min"

    def training_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = _pair(batch, "lm")
        logits = _output(model(x), "lm").float()
        if logits.dim() != 3 or logits.shape[:2] != y.shape:
            raise ConfigError(
                f"task=lm: the model returned {list(logits.shape)} for tokens {list(y.shape)}; "
                "it must return logits of shape (batch, time, vocabulary), e.g. model=gpt"
            )
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        acc = (logits.detach().argmax(-1) == y).double().mean()
        return {"loss": loss, "acc": acc}

    def derived(self, means: Mapping[str, float]) -> dict[str, float]:
        loss = means.get("loss")
        return {} if loss is None else {"ppl": math.exp(min(loss, 700.0))}
