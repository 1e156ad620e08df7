"""``python -m ddpexp.find batch``: the largest per-worker ``data.batch_size`` that fits.

Each trial runs ``trial_steps`` real training steps at one size (forward, backward, the
optimizer's step) and one validation batch, on the experiment's own data. The size doubles
from ``start`` until a trial runs out of memory (``torch.OutOfMemoryError``) or reaches
``max_batch`` (or the data a worker holds); then the search halves the gap between the last
size that fitted and the first that did not.

**Every rank agrees on every verdict.** A rank that runs out of memory must not leave the
others waiting in a collective: within a trial each rank computes its gradients locally (the
strategy's gradient sync held back), then all ranks exchange one flag (did any fail?) before
any gradient is summed, and again after the optimizer's step and after validation. A size
that failed on any rank failed for all; every rank empties its CUDA cache and goes on to the
next trial in the same process group. So nothing is left inside a collective, and nothing
hangs.

On the CPU memory does not run out this way: each trial's samples per second (over its steps
after the first) is what tells the sizes apart, and the search reports the size past which
doubling raises throughput by under 5%. Global rank 0 writes ``find/batch.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ddpexp.config.modes import RunMode, SpecView
from ddpexp.errors import ConfigError
from ddpexp.modes.find_lr import FIND_DIR, Steppable

log = logging.getLogger("ddpexp")

# Throughput that grows by less than this when the size doubles has levelled off.
KNEE = 1.05


@dataclasses.dataclass(frozen=True)
class FindBatch(RunMode):
    """The batch search's settings (``find.*`` on the command line, docs/find.md)."""

    start: int = 1
    max_batch: int = 4096
    trial_steps: int = 5
    name: ClassVar[str] = "find_batch"

    def __post_init__(self) -> None:
        if self.start < 1 or self.max_batch < self.start:
            raise ConfigError(f"find.start={self.start} and find.max_batch={self.max_batch}: "
                              "1 <= start <= max_batch")
        if self.trial_steps < 2:
            raise ConfigError(f"find.trial_steps={self.trial_steps} must be >= 2 (the first "
                              "step's time is not counted)")

    def run(self, trainer: Steppable, spec: SpecView) -> dict | None:  # pyright: ignore[reportIncompatibleMethodOverride]  # the trainer offers both
        if getattr(trainer.strategy, "staged_save", False):
            raise ConfigError("find batch under strategy=fsdp is not supported yet: its "
                              "forward gathers parameters in collectives that a rank out of "
                              "memory would leave; search at strategy=ddp and scale by the "
                              "memory fsdp saves")
        result = search(trainer, self)
        if trainer.ctx.is_main:
            out = Path(trainer.run_dir) / FIND_DIR
            out.mkdir(parents=True, exist_ok=True)
            (out / "batch.json").write_text(json.dumps(result, indent=1) + "\n")
        return result


def search(trainer: Steppable, f: FindBatch) -> dict[str, Any]:
    """Double, then bisect; every rank returns the same record."""
    shard = len(trainer.train_sampler)
    ceiling = min(f.max_batch, shard)
    tried: list[dict[str, Any]] = []
    fits, fails = 0, None
    size = min(f.start, ceiling)
    while True:
        verdict = trial(trainer, size, f.trial_steps)
        tried.append(verdict)
        if verdict["fits"]:
            fits = size
            if size >= ceiling:
                break
            size = min(size * 2, ceiling)
        else:
            fails = size
            break
    if fails is not None:
        low, high = fits, fails
        while high - low > 1:
            middle = (low + high) // 2
            verdict = trial(trainer, middle, f.trial_steps)
            tried.append(verdict)
            low, high = (middle, high) if verdict["fits"] else (low, middle)
        fits = low
    if fits == 0:
        raise ConfigError("not even data.batch_size=1 fits: a single sample runs out of memory "
                          "on some worker (a smaller model, trainer.precision=bf16, "
                          "trainer.activation_checkpointing=true or strategy=fsdp need less)")
    return {"batch_size": fits, "tried": tried, "limited_by": _limit(fails, fits, ceiling, f,
                                                                   shard),
            "knee": knee(tried), "world_size": trainer.ctx.world_size,
            "dp_size": trainer.ctx.dp_size}


def _limit(fails: int | None, fits: int, ceiling: int, f: FindBatch, shard: int) -> str:
    if fails is not None:
        return "memory"
    return "find.max_batch" if ceiling == f.max_batch else f"the data ({shard} samples a worker)"


def knee(tried: list[dict[str, Any]]) -> int | None:
    """The size past which doubling raised samples per second by under 5%: the smallest
    fitting size whose double (where tried) is under 1.05 times as fast."""
    speed = {t["batch_size"]: t["samples_per_s"] for t in tried if t["fits"]}
    for size in sorted(speed):
        if 2 * size in speed and speed[2 * size] < KNEE * speed[size]:
            return size
    return None


def trial(trainer: Steppable, size: int, steps: int) -> dict[str, Any]:
    """``steps`` training steps and one validation batch at ``size``; the verdict every rank
    agreed on, with samples per second over the steps after the first."""
    data = copy.copy(trainer.data)
    data.batch_size = size
    on_gpu = trainer.device.type == "cuda"
    loader = data.loader(trainer.train_sampler.dataset, trainer.train_sampler, seed=0,
                         on_gpu=on_gpu, train=True)
    batches = _cycle(trainer, loader)
    trainer.model.train()
    failed, began, counted = False, 0.0, 0
    for k in range(steps):
        if k == 1:
            began = time.perf_counter()
        failed = _agree(trainer, _guard(lambda: _local_step(trainer, next(batches))))
        if failed:
            break
        failed = _agree(trainer, _guard(lambda: _sync_and_step(trainer)))
        if failed:
            break
        if k >= 1:
            counted += size
    elapsed = time.perf_counter() - began
    if not failed:
        failed = _agree(trainer, _guard(lambda: _validate_one(trainer, size)))
    trainer.optimizer.zero_grad(set_to_none=True)
    if failed and trainer.device.type == "cuda":
        _release()  # what the failed step held, before the next size
    verdict: dict[str, Any] = {"batch_size": size, "fits": not failed}
    if not failed:
        verdict["samples_per_s"] = round(counted * trainer.ctx.dp_size / elapsed, 1) \
            if elapsed > 0 else None
    if trainer.ctx.is_main:
        log.info("find batch: data.batch_size=%d %s%s", size, "fits" if not failed else
                 "runs out of memory", f", {verdict['samples_per_s']} samples/s"
                 if not failed else "")
    return verdict


def _cycle(trainer: Steppable, loader: Any) -> Iterator[Any]:
    epoch = 0
    while True:
        trainer.train_sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _guard(work) -> bool:
    """Run ``work``; True where it ran out of memory (any other error is raised)."""
    try:
        work()
        return False
    except torch.OutOfMemoryError:
        return True


def _agree(trainer: Steppable, failed: bool) -> bool:
    """Whether any rank failed: one collective every rank reaches, failed or not."""
    if not (dist.is_available() and dist.is_initialized()) or trainer.ctx.world_size == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=trainer.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _local_step(trainer: Steppable, batch: Any) -> None:
    """Forward and backward of one batch with the strategy's gradient sync held back."""
    batch = trainer.to_device(batch)
    with trainer.strategy.no_sync(trainer.model, False):
        with trainer.autocast():
            out = trainer.task.training_step(trainer.forward, batch)
        trainer.scaler.scale(out["loss"]).backward()


def _sync_and_step(trainer: Steppable) -> None:
    """The gradient sum over the replicas the strategy held back, then the optimizer's step."""
    if trainer.ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
        for p in trainer.params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(trainer.ctx.world_size)
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    trainer.optimizer.zero_grad(set_to_none=True)


def _validate_one(trainer: Steppable, size: int) -> None:
    """One validation batch of ``size`` (as many samples as the split has, at most)."""
    val = trainer.val_ds
    n = min(size, len(val))
    if n == 0:
        return
    batch = torch.utils.data.default_collate([val[i] for i in range(n)])
    trainer.model.eval()
    try:
        with torch.no_grad(), trainer.autocast():
            trainer.task.validation_step(trainer.forward, trainer.to_device(batch))
    finally:
        trainer.model.train()


def _release() -> None:
    """Free what a trial that ran out of GPU memory left: its graph, then the cache."""
    gc.collect()
    torch.cuda.empty_cache()
