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

Under a strategy whose forward runs collectives (fsdp gathers each block's parameters) a
rank out of memory mid-forward has skipped a collective the others are waiting in, and no
flag can reach them. There each trial is *fenced*: it runs the strategy's own steps (gradient
sync included, as training would); the rank that fails writes the trial's key in the store
the ranks share and leaves the group; the others' collective ends (NCCL: a watcher thread
aborts the communicator once the key is there; gloo: the collective times out after a bound
set for the trial from the steps seen so far), and every rank, having failed the trial, meets
the others in a new process group, where the trainer is built again (:class:`Fence`).

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
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ddpexp.config.modes import RunMode, SpecView
from ddpexp.errors import ConfigError
from ddpexp.modes.find_lr import FIND_DIR, Steppable
from ddpexp.runtime.dist import regroup

log = logging.getLogger("ddpexp")

# Throughput that grows by less than this when the size doubles has levelled off.
KNEE = 1.05
# A fenced trial's collectives wait at least this long for a slow rank (gloo), and at least
# this many times the slowest step seen, scaled to the trial's size.
FENCE_FLOOR_S = 5.0
FENCE_STEPS = 10
FENCE_FIRST_S = 60.0  # before any size has fitted: nothing measured yet


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
        trials = Trials(trainer, spec)
        try:
            result = search(trials, self)
        finally:
            trials.close()
        trainer = trials.trainer
        if trainer.ctx.is_main:
            out = Path(trainer.run_dir) / FIND_DIR
            out.mkdir(parents=True, exist_ok=True)
            (out / "batch.json").write_text(json.dumps(result, indent=1) + "\n")
        return result


def search(trials: Trials, f: FindBatch) -> dict[str, Any]:
    """Double, then bisect; every rank returns the same record."""
    shard = len(trials.trainer.train_sampler)
    ceiling = min(f.max_batch, shard)
    tried: list[dict[str, Any]] = []
    fits, fails = 0, None
    size = min(f.start, ceiling)
    while True:
        verdict = trials.run(size, f.trial_steps)
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
            verdict = trials.run(middle, f.trial_steps)
            tried.append(verdict)
            low, high = (middle, high) if verdict["fits"] else (low, middle)
        fits = low
    if fits == 0:
        raise ConfigError("not even data.batch_size=1 fits: a single sample runs out of memory "
                          "on some worker (a smaller model, trainer.precision=bf16, "
                          "trainer.activation_checkpointing=true or strategy=fsdp need less)")
    return {"batch_size": fits, "tried": tried, "limited_by": _limit(fails, fits, ceiling, f,
                                                                   shard),
            "knee": knee(tried), "world_size": trials.trainer.ctx.world_size,
            "dp_size": trials.trainer.ctx.dp_size, "regrouped": trials.regrouped}


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


class Trials:
    """The trials of one search, on its trainer; under a strategy whose forward runs
    collectives, each fenced (:class:`Fence`), the trainer built anew after one failed."""

    def __init__(self, trainer: Steppable, spec: SpecView) -> None:
        self.trainer = trainer
        self.fence = Fence(trainer.ctx, spec) if trainer.strategy.collective_forward \
            and trainer.ctx.world_size > 1 else None
        self.regrouped = 0

    def run(self, size: int, steps: int) -> dict[str, Any]:
        """One trial at ``size``: the verdict every rank agreed on."""
        if self.fence is None:
            return trial(self.trainer, size, steps)
        with self.fence.trial(size) as guard:
            verdict = trial(self.trainer, size, steps, guard)
        if verdict["fits"] and self.fence.failed():
            # An aborted NCCL collective may return instead of raising: the store decides.
            verdict = {"batch_size": size, "fits": False}
        if verdict["fits"]:
            self.fence.fitted(size, verdict.pop("step_s"))
        else:
            self.regrouped += 1
            self.trainer = self.fence.rejoin(self.trainer)
        return verdict

    def close(self) -> None:
        if self.fence is not None:
            self.fence.close()


def trial(trainer: Steppable, size: int, steps: int,
          fenced: Callable[[Steppable, Callable[[], None]], bool] | None = None) -> dict[str, Any]:
    """``steps`` training steps and one validation batch at ``size``; the verdict every rank
    agreed on, with samples per second over the steps after the first. ``fenced``: a fenced
    trial's phase (:class:`_FencedTrial`), which runs the strategy's own steps."""
    data = copy.copy(trainer.data)
    data.batch_size = size
    on_gpu = trainer.device.type == "cuda"
    loader = data.loader(trainer.train_sampler.dataset, trainer.train_sampler, seed=0,
                         on_gpu=on_gpu, train=True)
    batches = _cycle(trainer, loader)
    phase = fenced or _agreed
    trainer.model.train()
    failed, began, counted = False, 0.0, 0
    for k in range(steps):
        if k == 1:
            began = time.perf_counter()
        if fenced:  # the strategy's own step: a collective that fails is the verdict
            failed = phase(trainer, lambda: _full_step(trainer, next(batches)))
        else:
            failed = phase(trainer, lambda: _local_step(trainer, next(batches))) or \
                phase(trainer, lambda: _sync_and_step(trainer))
        if failed:
            break
        if k >= 1:
            counted += size
    elapsed = time.perf_counter() - began
    if not failed:
        failed = phase(trainer, lambda: _validate_one(trainer, size))
    trainer.optimizer.zero_grad(set_to_none=True)
    if failed and fenced is None:
        _release()  # what the failed step held, before the next size
    verdict: dict[str, Any] = {"batch_size": size, "fits": not failed}
    if not failed:
        verdict["samples_per_s"] = round(counted * trainer.ctx.dp_size / elapsed, 1) \
            if elapsed > 0 else None
        if fenced:
            verdict["step_s"] = elapsed / max(1, steps - 1)
    if trainer.ctx.is_main:
        log.info("find batch: data.batch_size=%d %s%s", size, "fits" if not failed else
                 "runs out of memory", f", {verdict['samples_per_s']} samples/s"
                 if not failed else "")
    return verdict


class Fence:
    """A search's trials under a strategy whose forward runs collectives: a rank that runs
    out of memory inside one says so in the store the ranks share (one key a trial) and runs
    no further collective; the others learn it when their next collective ends in an error
    (NCCL: a watcher thread aborts the communicator once the key is there; gloo: the group's
    collectives time out after a bound set per trial). Then every rank meets the others in a
    new process group on the same store, and the trainer is built again there."""

    def __init__(self, ctx: Any, spec: Any) -> None:
        self.ctx, self.spec = ctx, spec
        self.store = dist.distributed_c10d._get_default_store()
        self.nccl = dist.get_backend() == "nccl"
        self.timeout_s = float(spec.trainer.dist_timeout_s)
        self.count = 0  # trials so far: every rank counts the same
        self.generation = 0
        self.step_s: dict[int, float] = {}  # a fitting size's step time
        self.key = ""

    def trial(self, size: int) -> _FencedTrial:
        self.count += 1
        self.key = f"ddpexp/find-batch/failed-{self.count}"
        if not self.nccl:  # NCCL's watchdog would end the process at a timeout
            dist.set_timeout(timedelta(seconds=self.bound(size)))
        return _FencedTrial(self)

    def bound(self, size: int) -> float:
        """How long a collective of a trial at ``size`` may wait for a slow rank."""
        if not self.step_s:
            return FENCE_FIRST_S
        fitted = max(self.step_s)
        return max(FENCE_FLOOR_S, FENCE_STEPS * self.step_s[fitted] * max(1.0, size / fitted))

    def fitted(self, size: int, step_s: float) -> None:
        self.step_s[size] = step_s

    def failed(self) -> bool:
        """Whether some rank failed this trial (its key is in the store)."""
        return self.store.check([self.key])

    def report(self) -> None:
        self.store.set(self.key, str(self.ctx.rank))

    def rejoin(self, trainer: Steppable) -> Steppable:
        """Every rank, after a failed trial: a new process group, a trainer built in it."""
        from ddpexp.training.trainer import Trainer

        # The failed trial's weights and optimizer state go before the new ones come (the
        # worker that called the mode still holds the first trainer: its tensors are freed
        # here, not by dropping the reference).
        trainer.optimizer.state.clear()
        trainer.model.to("meta")
        del trainer
        _release()
        self.generation += 1
        self.ctx = regroup(self.ctx, self.store, self.generation, self.timeout_s)
        return Trainer.from_spec(self.spec, self.ctx)  # pyright: ignore[reportReturnType]  # a Trainer is Steppable

    def close(self) -> None:
        if not self.nccl and dist.is_initialized():
            dist.set_timeout(timedelta(seconds=self.timeout_s))


class _FencedTrial:
    """One fenced trial: the NCCL watcher while it runs, and its ``phase`` function."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self.done = threading.Event()
        self.watcher: threading.Thread | None = None

    def __enter__(self) -> Callable[[Steppable, Callable[[], None]], bool]:
        if self.fence.nccl:
            self.watcher = threading.Thread(target=self._watch, name="ddpexp-find-fence",
                                            daemon=True)
            self.watcher.start()
        return self.phase

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.watcher is not None:
            self.watcher.join()

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            if self.fence.failed():
                dist.distributed_c10d._abort_process_group()
                return

    def phase(self, trainer: Steppable, work: Callable[[], None]) -> bool:
        """``work``, then one flag exchanged (it fails where a rank left the group after its
        last collective); True where this rank, or another, failed."""
        try:
            work()
            _agreed(trainer, lambda: None)
            return False
        except torch.OutOfMemoryError:
            self.fence.report()
            return True
        except (dist.DistError, RuntimeError):
            if _reported(self.fence):
                return True
            raise


def _reported(fence: Fence, wait_s: float = 1.0) -> bool:
    """Whether a rank has failed this trial: the key can come a moment after the error."""
    deadline = time.monotonic() + wait_s
    while not fence.failed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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


def _agreed(trainer: Steppable, work: Callable[[], None]) -> bool:
    """``work`` on every rank; whether it ran out of memory on any."""
    return _agree(trainer, _guard(work))


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
    """The gradient mean over the data-parallel replicas (the sync the strategy held back),
    then the optimizer's step."""
    if trainer.ctx.dp_size > 1 and dist.is_available() and dist.is_initialized():
        for p in trainer.params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=trainer.ctx.dp_group)
                p.grad.div_(trainer.ctx.dp_size)
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    trainer.optimizer.zero_grad(set_to_none=True)


def _full_step(trainer: Steppable, batch: Any) -> None:
    """One training step as the strategy trains: forward, backward with its gradient sync,
    the optimizer's step."""
    batch = trainer.to_device(batch)
    with trainer.autocast():
        out = trainer.task.training_step(trainer.forward, batch)
    trainer.scaler.scale(out["loss"]).backward()
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
    """Free what a trial that ran out of memory left: its graph, then the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

