"""The data loaders of one rank: its shard of the training split (resumable mid-epoch),
and unpadded shards of the validation and test splits, so that every evaluated sample counts
exactly once whatever the world size; and its batches on the device."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import Dataset, Subset

from ddpexp.config.schema import TrainerConfig
from ddpexp.data.base import DataSource, ResumableDistributedSampler
from ddpexp.runtime.dist import DistContext, derive_seed

if TYPE_CHECKING:
    from ddpexp.strategies.base import Strategy

log = logging.getLogger(__name__)


@dataclass
class Loaders:
    """What :func:`build` makes for one rank."""

    train_sampler: ResumableDistributedSampler
    train_loader: Any
    batches_per_epoch: int  # the epoch's length on this rank (limit/overfit applied)
    rank_train_samples: int  # samples this rank trains on per epoch (its padding left out)
    epoch_samples: int  # samples all data-parallel ranks together train on per epoch
    val_ds: Dataset
    val_loader: Any
    test_ds: Dataset | None
    rank_seed: int


def build(t: TrainerConfig, ctx: DistContext, data: DataSource, datasets: Sequence[Dataset],
          seed: int, strategy: Strategy | None = None) -> Loaders:
    """This rank's loaders of ``datasets`` = (train, val[, test]), each split cut into
    ``strategy``'s data-parallel shards (None: one per rank of ``ctx``)."""
    train_ds, val_ds = datasets[0], datasets[1]
    on_gpu = ctx.device.type == "cuda"
    overfit = t.overfit_batches
    rank, replicas = _shard(ctx, strategy)
    sampler = ResumableDistributedSampler(train_ds, num_replicas=replicas, rank=rank,
                                          shuffle=overfit is None, seed=seed, drop_last=False)
    _warn_readers(ctx, data, train_ds, replicas)
    # Seeded by the shard: ranks that share one (a model-parallel group) draw the same batches.
    rank_seed = derive_seed(seed, rank)
    train_loader = data.loader(train_ds, sampler, seed=rank_seed, on_gpu=on_gpu, train=True)
    limit = overfit or t.limit_train_batches
    batches = len(train_loader) if limit is None else min(limit, len(train_loader))
    if overfit is not None:
        # Unshuffled, rank r trains on indices r, r + world, ...: the first batches of all
        # ranks together are the dataset's first samples, which are validated on.
        trained = min(len(cast(Sized, train_ds)), overfit * data.batch_size * replicas)
        val_ds = Subset(train_ds, range(trained))
    return Loaders(
        train_sampler=sampler, train_loader=train_loader, batches_per_epoch=batches,
        rank_train_samples=min(sampler.real_samples, batches * data.batch_size),
        epoch_samples=min(len(cast(Sized, train_ds)), batches * data.batch_size * replicas),
        val_ds=val_ds, val_loader=eval_loader(t, ctx, data, val_ds, rank_seed, strategy),
        test_ds=datasets[2] if len(datasets) > 2 else None, rank_seed=rank_seed,
    )


def _warn_readers(ctx: DistContext, data: DataSource, train_ds: Dataset, replicas: int) -> None:
    """One warning where sharded data has fewer shards than readers (ranks x loader workers),
    saying how its samples are dealt out instead."""
    shards = getattr(train_ds, "shard_count", None)
    readers = replicas * max(1, data.num_workers)
    if shards is None or readers <= shards or not ctx.is_main:
        return
    log.warning("%d data-parallel ranks x %d loader workers = %d readers of %d training shards: "
                "the samples are dealt out by global batch, not by shard, so each is still read "
                "once an epoch, and the readers share shards", replicas, max(1, data.num_workers),
                readers, shards)


def eval_loader(t: TrainerConfig, ctx: DistContext, data: DataSource, dataset: Dataset,
                rank_seed: int, strategy: Strategy | None = None) -> Any:
    """This rank's shard of ``dataset``, without padding (``trainer.limit_val_batches``
    applied); the shards are ``strategy``'s data-parallel ones, as in :func:`build`."""
    rank, replicas = _shard(ctx, strategy)
    shard = range(rank, len(cast(Sized, dataset)), replicas)  # map-style
    loader = data.loader(dataset, list(shard), seed=rank_seed, on_gpu=ctx.device.type == "cuda",
                         train=False)
    limit = t.limit_val_batches
    return loader if limit is None else FirstBatches(loader, limit)


def _shard(ctx: DistContext, strategy: Strategy | None) -> tuple[int, int]:
    """(this rank's shard, the number of shards) each split is cut into."""
    if strategy is None:
        return ctx.dp_rank, ctx.dp_size
    return strategy.dp_rank, strategy.dp_size


class FirstBatches:
    """The first ``limit`` batches of each pass over ``loader`` (trainer.limit_val_batches)."""

    def __init__(self, loader: Any, limit: int):
        self.loader, self.limit = loader, limit

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.limit)

    def __len__(self) -> int:
        return min(self.limit, len(self.loader))


def own_message(exc: Exception) -> Exception:
    """``exc`` as its raiser wrote it: a DataLoader worker's error reaches the training
    process carrying the worker's whole traceback as its message, of which the last line
    is the error itself."""
    text = str(exc)
    if "Original Traceback" not in text:
        return exc
    last = text.rstrip().splitlines()[-1]
    prefix = f"{type(exc).__module__}.{type(exc).__qualname__}: "
    return type(exc)(last[len(prefix):] if last.startswith(prefix) else last)


def mean_share(epoch_samples: int, batch_size: int, shares: int, first: int, end: int) -> float:
    """The samples of micro-batches ``first`` to ``end`` (an optimizer step) over all
    ``shares`` data-parallel ranks, divided by their number: what one rank's loss is weighted
    against, so that ranks of unequal shares (an epoch the world size does not divide) give
    the mean gradient of all the step's samples."""
    per_step = batch_size * shares
    total = min(epoch_samples - first * per_step, (end - first) * per_step)
    return total // shares if total % shares == 0 else total / shares


def without_padding(batch: Any, real: int, size: int, count: Any) -> tuple[Any, int]:
    """``batch`` (``size`` samples, of which the first ``real`` are the epoch's, the rest the
    sampler's padding) and the samples it counts for: cut to ``real`` where ``count`` (the
    task's batch_size) agrees with the cut; a batch of padding alone counts 0, so that its
    rank steps with the others and its loss counts for nothing."""
    if real <= 0:
        return batch, 0
    cut = first_samples(batch, real, size)
    return (cut, real) if count(cut) == real else (batch, size)


def first_samples(batch: Any, n: int, size: int) -> Any:
    """The first ``n`` samples of ``batch`` (``size`` of them): every tensor in it whose first
    dimension is ``size`` cut to ``n``, in any nesting of tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return type(batch)((k, first_samples(v, n, size)) for k, v in batch.items())  # pyright: ignore[reportCallIssue]  # as in to_device
    if isinstance(batch, (list, tuple)):
        cut = [first_samples(v, n, size) for v in batch]
        return type(batch)(*cut) if hasattr(batch, "_fields") else type(batch)(cut)
    return batch


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format) -> Any:
    """``batch`` (tensors in any nesting of tuples, lists and dicts) on ``device``; 4-d float
    tensors in channels_last where ``memory_format`` asks for it."""
    if isinstance(batch, torch.Tensor):
        if device.type != "cpu":
            batch = batch.to(device, non_blocking=True)
        if memory_format is torch.channels_last and batch.dim() == 4 and batch.is_floating_point():
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, Mapping):
        moved_items = ((k, to_device(v, device, memory_format)) for k, v in batch.items())
        return type(batch)(moved_items)  # pyright: ignore[reportCallIssue]  # a Mapping type built from its items, as dict is
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device, memory_format) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
