"""Datasets the ``data`` config group points at, and the loaders that feed a rank.

Each ``data`` option is a :class:`DataSource`: it knows its loader settings, its
``num_classes`` and ``shape``, and builds its train, validation and test datasets. No sample is
in two of them: in-memory data is split three ways by a fixed seed; file-based data holds the
validation set out of the training files and keeps the official test files as the test set, so
that what a run selects on (``best.pt``, early stopping, a sweep's ranking) never saw them.

Datasets that fit in memory are :class:`InMemory` tensors and are batched by indexing
(:class:`TensorLoader`), which is far cheaper than collating samples one by one; the rest go
through a ``DataLoader``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddpexp.config.lists import as_list
from ddpexp.errors import ConfigError


class InMemory(Dataset):
    """Samples held as two tensors; ``transform`` (optional) runs per sample."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, transform: Any = None):
        self.x, self.y, self.transform = x, y, transform

    @property
    def deterministic(self) -> bool:
        """Whether a sample is the same at every read (no transform, so nothing random)."""
        return self.transform is None

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = self.x[i]
        return (self.transform(x) if self.transform is not None else x), self.y[i]


class ResumableDistributedSampler(DistributedSampler):
    """PyTorch's DistributedSampler, elastic: an epoch's global order depends on ``seed`` and
    the epoch alone (a dataset's own ``epoch_order(seed, epoch)`` where it has one, such as
    sharded data that keeps its reads local; else DistributedSampler's permutation), and
    rank ``r`` of ``R`` takes its positions ``r, r + R, ...``, so that the data-parallel
    ranks' micro-batches at one step together are the next contiguous run of that order,
    whatever ``R``. An epoch can start part-way through (``skip``, in this rank's samples), so
    that a run resumed mid-epoch sees exactly the samples the interrupted run had not seen.

    Where ``R`` does not divide the epoch, the rank streams are padded to one length with
    the epoch's first samples, as DistributedSampler pads them, so that every rank steps
    alike; :attr:`real_samples` says where this rank's stream turns to padding, and the
    trainer leaves the padding out of the loss (each sample of the epoch counts once)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    @property
    def real_samples(self) -> int:
        """This rank's samples of the epoch before its padding: the positions below the
        epoch's length that are ``rank`` mod ``num_replicas``."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return max(0, -(-(n - self.rank) // self.num_replicas))

    def global_order(self) -> list[int]:
        """The epoch's order of all samples, before it is dealt out to ranks."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        own = getattr(self.dataset, "epoch_order", None)
        if own is not None:
            return [int(i) for i in own(self.seed, self.epoch)]
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        if not self.drop_last:
            pad = self.total_size - len(order)
            while pad > 0:  # repeats of the epoch's first samples (DistributedSampler's padding)
                order += order[:pad]
                pad = self.total_size - len(order)
        mine = order[self.rank:self.total_size:self.num_replicas]
        return itertools.islice(iter(mine), self.skip, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


class TensorLoader:
    """Batches of an :class:`InMemory` dataset by tensor indexing, in the sampler's order."""

    def __init__(self, dataset: InMemory, batch_size: int, sampler: Sequence[int] | Any):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        order = torch.as_tensor(list(self.sampler), dtype=torch.long)
        x, y = self.dataset.x, self.dataset.y
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            # index_select, not x[idx]: the same gather, in half the time of advanced
            # indexing on CPU (45 vs 99 us for 32 samples of 3x32x32 floats).
            yield x.index_select(0, idx), y.index_select(0, idx)


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: numpy and ``random`` follow the worker's torch seed,
    which the loader derives from the rank's generator and the worker id."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class EpochKeys:
    """A training sampler's indices as ``(index, epoch)`` keys, which :class:`SeededSamples`
    draws a sample's random numbers from."""

    def __init__(self, sampler: ResumableDistributedSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((i, epoch) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's step: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s random draws in ``epoch`` (63 bits): distinct for the
    samples of one epoch, and made in about a microsecond, as it is once per sample."""
    return _mix(_mix(_mix(seed & _MASK64) ^ epoch) ^ index) >> 1


class SeededSamples(Dataset):
    """A training dataset read by ``(index, epoch)`` keys: torch's, numpy's and ``random``'s
    generators are seeded from (seed, epoch, index) before each sample is made, so that a
    random augmentation draws the same for a sample whichever rank, loader worker or world
    size reads it, and a run resumed mid-epoch draws what the uninterrupted run drew. In the
    training process itself (``data.num_workers=0``) the generators are put back after each
    batch, so the model's own draws (dropout) follow the run's stream alone."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _make(self, key: tuple[int, int]) -> Any:
        index, epoch = key
        s = sample_seed(self.seed, epoch, index)
        torch.default_generator.manual_seed(s)
        np.random.seed(s & 0xFFFFFFFF)
        random.seed(s)
        return self.dataset[index]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list:
        """A batch of samples (torch's DataLoader asks for a batch at once): the training
        process's generators are saved and put back once per batch (numpy's state alone
        costs 0.13 ms to save and restore)."""
        if torch.utils.data.get_worker_info() is not None:  # a loader worker's own generators
            return [self._make(k) for k in keys]
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            return [self._make(k) for k in keys]
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])


class DataSource:
    """Loader settings plus the datasets; subclasses implement :meth:`load`."""

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        num_classes: int | None = None,
        shape: Sequence[int] | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        fast_path: bool = True,
    ):
        if batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size} must be >= 1")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers} must be >= 0")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.num_classes = num_classes
        self.shape = tuple(as_list(shape)) if shape is not None else None  # data.shape=8: [8]
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.fast_path = fast_path

    def load(self) -> tuple[Dataset, ...]:
        """Return ``(train, val, test)``, or ``(train, val)`` for data without a test split."""
        raise NotImplementedError

    # The distribution the data ships with (``scikit-learn``), for the run's provenance.
    ships_with: str | None = None

    def data_files(self) -> list[Path]:
        """The files and dirs the data is read from, which the run's ``provenance.json``
        fingerprints: by default a ``path`` or ``root`` attribute of the source, where it has
        one; none for data made by code."""
        found = [getattr(self, name, None) for name in ("path", "root")]
        return [Path(p) for p in found if isinstance(p, (str, Path))]

    def loader(
        self,
        dataset: Dataset,
        sampler: Any,
        *,
        seed: int,
        on_gpu: bool,
        train: bool,
    ):
        """A loader over ``sampler``'s indices: :class:`TensorLoader` for transform-free
        in-memory data, else a ``DataLoader`` with per-rank seeded workers. Training samples
        of data that may draw random numbers are made by :class:`SeededSamples`."""
        if self.fast_path and isinstance(dataset, InMemory) and dataset.transform is None:
            return TensorLoader(dataset, self.batch_size, sampler)
        if train and isinstance(sampler, ResumableDistributedSampler) \
                and not getattr(dataset, "deterministic", False):
            dataset, sampler = SeededSamples(dataset, sampler.seed), EpochKeys(sampler)
        workers = self.num_workers
        extra: dict[str, Any] = {}
        if workers > 0:
            extra["persistent_workers"] = (
                self.persistent_workers if self.persistent_workers is not None else train
            )
            if self.prefetch_factor is not None:
                extra["prefetch_factor"] = self.prefetch_factor
        generator = torch.Generator()
        generator.manual_seed(seed)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=self.pin_memory if self.pin_memory is not None else on_gpu,
            worker_init_fn=seed_worker,
            generator=generator,
            **extra,
        )


def split_indices(n: int, val_fraction: float, test_fraction: float, seed: int,
                  labels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A deterministic split of ``range(n)`` into train, val and test indices (stratified by
    ``labels`` when given); every index lands in exactly one part."""
    for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= frac < 1.0:
            raise ConfigError(f"data.{name}={frac} must be in [0, 1)")
    if val_fraction <= 0 or val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction}: "
            "validation needs a share above 0, and both together must leave data to train on"
        )
    rest, test = np.arange(n), np.arange(0)
    if test_fraction > 0:
        rest, test = _two_way(rest, test_fraction, seed, labels)
    sub = None if labels is None else labels[rest]
    train, val = _two_way(rest, val_fraction / (1.0 - test_fraction), seed, sub)
    return np.sort(train), np.sort(val), np.sort(test)


def _two_way(index: np.ndarray, fraction: float, seed: int,
             labels: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``index`` cut into (kept, held out) with ``fraction`` held out, stratified where every
    class can give a sample to both parts (small or skewed data falls back to a plain shuffle,
    where scikit-learn would refuse).

    The draws are scikit-learn's ``train_test_split(index, test_size=held, random_state=seed,
    stratify=labels)``, made here with numpy alone (importing scikit-learn costs every worker
    a second at start-up); ``tests/unit/test_splits.py`` holds the two to the same indices."""
    held = int(np.ceil(fraction * len(index)))
    if len(index) < 2 or held < 1 or held >= len(index):
        raise ConfigError(
            f"a {fraction:.3g} share of {len(index)} samples leaves a part empty; "
            "use larger data or a different data.val_fraction/test_fraction"
        )
    kept_n = len(index) - held
    rng = np.random.RandomState(seed)
    if labels is not None:
        _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        if counts.min() >= 2 and held >= len(counts) and kept_n >= len(counts):
            kept, held_out = _stratified(inverse.reshape(-1), counts, kept_n, held, rng)
            return index[kept], index[held_out]
    order = rng.permutation(len(index))
    return index[order[held:held + kept_n]], index[order[:held]]


def _stratified(inverse: np.ndarray, counts: np.ndarray, kept_n: int, held: int,
                rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the kept and held-out samples, every class shared out in proportion to
    its size (scikit-learn's ``StratifiedShuffleSplit``, first split)."""
    per_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    kept_i = _apportion(counts, kept_n, rng)
    held_i = _apportion(counts - kept_i, held, rng)
    kept: list[int] = []
    held_out: list[int] = []
    for members, k, h in zip(per_class, kept_i, held_i, strict=True):
        shuffled = members.take(rng.permutation(len(members)), mode="clip")
        kept.extend(shuffled[:k])
        held_out.extend(shuffled[k:k + h])
    return rng.permutation(kept), rng.permutation(held_out)


def _apportion(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """``draws`` shared out over classes of ``counts``: each its floor of the proportional
    share, the rest to the largest remainders, ties broken at random."""
    share = counts / counts.sum() * draws
    out = np.floor(share)
    missing = int(draws - out.sum())
    if missing > 0:
        remainder = share - out
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            take = min(len(tied), missing)
            out[rng.choice(tied, size=take, replace=False)] += 1
            missing -= take
            if missing == 0:
                break
    return out.astype(int)
