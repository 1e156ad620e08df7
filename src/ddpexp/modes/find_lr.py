"""``python -m ddpexp.find lr``: the learning-rate range test (Smith 2015) on the composed
experiment, at its world size, strategy, precision and accumulation.

The lr grows exponentially from ``lr_min`` to ``lr_max`` over exactly ``steps`` optimizer steps
of real training (forward, backward, the optimizer's step) on the experiment's own data. Each
point's loss is the step's **global** loss: the sample-weighted mean over every data-parallel
replica, summed in one collective, so that every rank holds the same value and smooths it the
same way (an exponential moving average, bias-corrected). The search stops early only where
that smoothed loss diverges (``stop_factor`` times its lowest), and then on every rank at the
same step, since every rank decides on the same numbers.

The suggestion is the lr of the steepest fall of the smoothed loss against log lr, between
the first tenth of the points (the average still warming up) and the lowest loss. The trainer
the worker built for this is the search's own, in the finder's own run dir: no checkpoint is
written, and no run's files are touched. Global rank 0 writes ``find/lr.json``,
``find/lr.png`` and TensorBoard scalars (``find/loss``, ``find/raw_loss``, ``find/lr``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from ddpexp.config.modes import RunMode, SpecView
from ddpexp.errors import ConfigError

log = logging.getLogger("ddpexp")

FIND_DIR = "find"


class Steppable(Protocol):
    """What the search drives of the trainer (:class:`ddpexp.training.trainer.Trainer`)."""

    ctx: Any
    t: Any
    task: Any
    strategy: Any
    model: Any
    forward: Any
    optimizer: torch.optim.Optimizer
    scaler: Any
    params: list
    train_loader: Any
    train_sampler: Any
    data: Any
    val_ds: Any
    device: torch.device
    run_dir: Path

    def autocast(self) -> Any: ...

    def to_device(self, batch: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class FindLR(RunMode):
    """The range test's settings (``find.*`` on the command line, docs/find.md)."""

    lr_min: float = 1e-6
    lr_max: float = 1.0
    steps: int = 100
    smooth: float = 0.98
    stop_factor: float = 4.0
    name: ClassVar[str] = "find_lr"

    def __post_init__(self) -> None:
        problem = settings_problem(self)
        if problem:
            raise ConfigError(problem)

    def run(self, trainer: Steppable, spec: SpecView) -> dict | None:  # pyright: ignore[reportIncompatibleMethodOverride]  # the trainer offers both
        curve = search(trainer, self)
        result = {**curve, "suggested_lr": suggest(curve["lr"], curve["loss"])}
        if trainer.ctx.is_main:
            write(trainer.run_dir, result)
        return result


MIN_STEPS = 20


def settings_problem(f: FindLR) -> str | None:
    """Why the settings cannot make a curve, or None."""
    if not (f.lr_min > 0 and f.lr_max > 0):
        return f"find.lr_min={f.lr_min} and find.lr_max={f.lr_max} must be > 0"
    if f.lr_min >= f.lr_max:
        return (f"find.lr_min={f.lr_min} must be below find.lr_max={f.lr_max}: the range test "
                "raises the lr from the one to the other")
    if f.steps < MIN_STEPS:
        return (f"find.steps={f.steps} is too few to fit a curve: give at least {MIN_STEPS} "
                "(100 is the usual)")
    if not 0 <= f.smooth < 1:
        return f"find.smooth={f.smooth} must be in [0, 1) (0 = no smoothing)"
    if f.stop_factor <= 1:
        return f"find.stop_factor={f.stop_factor} must be > 1"
    return None


def lr_points(f: FindLR) -> list[float]:
    """The lr of each step: exponential from ``lr_min`` to ``lr_max``, both included."""
    ratio = f.lr_max / f.lr_min
    return [f.lr_min * ratio ** (i / (f.steps - 1)) for i in range(f.steps)]


def search(trainer: Steppable, f: FindLR) -> dict[str, Any]:
    """Run the range test; every rank returns the same curve."""
    lrs = lr_points(f)
    trainer.model.train()
    batches = _batches(trainer)
    accumulate = trainer.t.accumulate
    raw: list[float] = []
    smoothed: list[float] = []
    average, best, stopped = 0.0, math.inf, None
    began = first_done = time.perf_counter()
    for i, lr in enumerate(lrs):
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        loss = _step(trainer, [next(batches) for _ in range(accumulate)])
        if i == 0:
            first_done = time.perf_counter()
        if not math.isfinite(loss):
            if i == 0:
                raise ConfigError(
                    f"the loss is {loss} at the first step of the range test (lr={lr:g}): it "
                    "is no learning-rate problem; check the data, the model and the task")
            stopped = i
            break
        average = f.smooth * average + (1 - f.smooth) * loss
        value = average / (1 - f.smooth ** (i + 1))
        raw.append(loss)
        smoothed.append(value)
        best = min(best, value)
        if value > f.stop_factor * best:  # the same numbers on every rank: the same step
            stopped = i + 1
            break
    return {"lr": lrs[:len(smoothed)], "loss": smoothed, "raw_loss": raw,
            "steps": f.steps, "stopped_at": stopped, "lr_min": f.lr_min, "lr_max": f.lr_max,
            "search_s": round(time.perf_counter() - began, 3),
            # The mean step after the first (which pays for warm-up), as a loop's is timed.
            "step_s": (time.perf_counter() - first_done) / max(1, len(smoothed) - 1)}


def suggest(lrs: Sequence[float], losses: Sequence[float]) -> float | None:
    """The lr at the steepest fall of ``losses`` against log lr, between the first tenth of
    the points and the lowest loss; None where the loss never falls there."""
    if len(losses) < 3:
        return None
    skip = max(1, len(losses) // 10)
    lowest = min(range(len(losses)), key=losses.__getitem__)
    if lowest - skip < 2:
        return None
    logs = [math.log(lr) for lr in lrs]
    slopes = [(losses[i + 1] - losses[i - 1]) / (logs[i + 1] - logs[i - 1])
              for i in range(skip, lowest)]
    at = min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[skip + at] if slopes[at] < 0 else None


def _batches(trainer: Steppable) -> Iterator[Any]:
    """This rank's training batches, epoch after epoch, as the loop would see them."""
    epoch = 0
    while True:
        trainer.train_sampler.set_epoch(epoch)
        yield from trainer.train_loader
        epoch += 1


def _step(trainer: Steppable, micro: list[Any]) -> float:
    """One optimizer step on ``micro`` (the step's micro-batches), weighted as the loop weighs
    them; returns the global sample-weighted mean loss of the step."""
    micro = [trainer.to_device(b) for b in micro]
    sizes = [trainer.task.batch_size(b) for b in micro]
    total = sum(sizes)
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for k, (batch, n) in enumerate(zip(micro, sizes, strict=True)):
        with trainer.strategy.no_sync(trainer.model, k + 1 == len(micro)):
            with trainer.autocast():
                out = trainer.task.training_step(trainer.forward, batch)
            trainer.scaler.scale(out["loss"] * (n / total)).backward()
        loss_sum += out["loss"].detach().double() * n
    if trainer.t.grad_clip is not None:
        trainer.scaler.unscale_(trainer.optimizer)
        trainer.strategy.clip(trainer.params, trainer.t.grad_clip)
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    trainer.optimizer.zero_grad(set_to_none=True)
    counted = torch.stack([loss_sum, torch.tensor(float(total), dtype=torch.float64,
                                                  device=trainer.device)])
    if not trainer.ctx.counts_samples:
        counted.zero_()  # this rank's samples are its model-parallel group's first rank's
    if dist.is_available() and dist.is_initialized() and trainer.ctx.world_size > 1:
        dist.all_reduce(counted)
    summed, samples = counted.tolist()
    return summed / samples if samples else math.nan


def write(run_dir: Path, result: dict) -> Path:
    """``find/lr.json``, ``find/lr.png`` and the TensorBoard scalars of the curve."""
    out = Path(run_dir) / FIND_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "lr.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "lr.png")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(Path(run_dir) / "tb")) as writer:
        for step, (lr, loss, raw) in enumerate(zip(result["lr"], result["loss"],
                                                   result["raw_loss"], strict=True)):
            writer.add_scalar("find/lr", lr, step)
            writer.add_scalar("find/loss", loss, step)
            writer.add_scalar("find/raw_loss", raw, step)
    return out / "lr.json"


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(result["lr"], result["raw_loss"], color="0.75", linewidth=1, label="loss")
    ax.plot(result["lr"], result["loss"], linewidth=2, label="smoothed")
    suggested = result.get("suggested_lr")
    if suggested is not None:
        ax.axvline(suggested, color="tab:red", linestyle="--", label=f"suggested {suggested:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("global training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
