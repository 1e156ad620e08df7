"""``data=shards``: samples in WebDataset tar shards on disk, read a sample at a time, so that
data far larger than memory trains without being loaded.

A shard is a plain tar file; a sample is the members that share a key (the member's path up
to the first dot of its file name), one member per field: ``000017.npy`` and ``000017.cls``
are the input and the target of sample ``000017``. Each shard's members are indexed once, at
start-up, by their offsets in the file (only the tar headers are read), and a sample is then
two positioned reads (``os.pread``) in whichever process reads it.

The epoch's order is the shards shuffled by (seed, epoch), cut into blocks of ``data.block``
shards, and each block's samples shuffled among themselves: a global batch comes from one
block, so the readers of all ranks and loader workers read a few shards at a time, and the
order is the same whatever the number of ranks and workers (the sampler deals it out,
:class:`ddpexp.data.base.ResumableDistributedSampler`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpexp.data.base import DataSource, split_indices
from ddpexp.data.sources import _instantiate_transforms
from ddpexp.errors import ConfigError, DataError

log = logging.getLogger(__name__)

IMAGES = ("png", "jpg", "jpeg", "ppm", "bmp", "webp")
INTEGERS = ("cls", "cls2", "index", "id")


def decode(field: str, raw: bytes) -> torch.Tensor:
    """One member's bytes as a tensor, by the field's last extension: ``npy`` (an array),
    ``cls``/``index``/``id`` (an integer in text), ``json`` (a number or a list of them),
    ``pt`` (a tensor torch.save wrote), images (float CHW in [0, 1])."""
    kind = field.rsplit(".", 1)[-1].lower()
    if kind == "npy":
        array = np.load(io.BytesIO(raw), allow_pickle=False)
        return torch.from_numpy(array.astype(np.float32) if array.dtype == np.float64 else array)
    if kind in INTEGERS:
        return torch.tensor(int(raw.decode().strip()))
    if kind == "json":
        value = torch.tensor(json.loads(raw))
        return value.float() if value.is_floating_point() else value
    if kind in ("pt", "pth"):
        return torch.load(io.BytesIO(raw), weights_only=True)
    if kind in IMAGES:
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        with Image.open(io.BytesIO(raw)) as image:
            return pil_to_tensor(image.convert("RGB" if image.mode not in ("L", "RGB") else image.mode)).float().div_(255)
    raise ConfigError(f"data=shards: cannot decode a {field!r} member; known kinds: npy, "
                      f"{', '.join(INTEGERS)}, json, pt, {', '.join(IMAGES)}")


class ShardIndex:
    """Where each sample's input and target lie in the shards: per sample its shard number
    and the (offset, size) of both members."""

    def __init__(self, paths: Sequence[Path], input_key: str, target_key: str):
        self.paths = [str(p) for p in paths]
        shard, spans = [], []
        for number, path in enumerate(paths):
            samples = _members(path, input_key, target_key)
            shard.extend([number] * len(samples))
            spans.extend(samples)
        self.shard = np.asarray(shard, dtype=np.int64)
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 4)

    def __len__(self) -> int:
        return len(self.shard)


def _members(path: Path, input_key: str, target_key: str) -> list[tuple[int, int, int, int]]:
    """``path``'s samples in file order, as (input offset, input size, target offset,
    target size); a sample without one of the two fields is refused, naming what it has."""
    fields: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, name = member.name.rpartition("/")
                stem, dot, field = name.partition(".")
                if not dot:
                    continue
                key = f"{folder}/{stem}" if folder else stem
                fields.setdefault(key, {})[field] = (member.offset_data, member.size)
    except (OSError, tarfile.TarError) as exc:
        raise ConfigError(f"data=shards: cannot read the shard {path}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    out = []
    for key, have in fields.items():
        missing = [k for k in (input_key, target_key) if k not in have]
        if missing:
            raise ConfigError(
                f"data=shards: sample {key!r} of {path} has no {missing[0]!r} member "
                f"(data.{'input_key' if missing[0] == input_key else 'target_key'}); "
                f"its members: {', '.join(sorted(have))}")
        out.append((*have[input_key], *have[target_key]))
    return out


class ShardSamples(Dataset):
    """Samples ``rows`` of a :class:`ShardIndex`, each read from its shard when asked for; the
    files are opened once per process, at their first read."""

    def __init__(self, index: ShardIndex, rows: np.ndarray, fields: tuple[str, str],
                 block: int, transform: Any = None):
        self.index, self.rows, self.fields = index, np.asarray(rows, dtype=np.int64), fields
        self.block, self.transform = block, transform
        self._files: dict[int, int] = {}
        self._pid = os.getpid()

    @property
    def deterministic(self) -> bool:
        return self.transform is None

    @property
    def shard_count(self) -> int:
        return len(np.unique(self.index.shard[self.rows]))

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict:  # a loader worker opens its own files
        return {**self.__dict__, "_files": {}}

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = int(self.rows[int(i)])
        number = int(self.index.shard[row])
        in_off, in_size, tg_off, tg_size = (int(v) for v in self.index.spans[row])
        x = decode(self.fields[0], self._read(number, in_off, in_size))
        y = decode(self.fields[1], self._read(number, tg_off, tg_size))
        return (self.transform(x) if self.transform is not None else x), y

    def _read(self, number: int, offset: int, size: int) -> bytes:
        if os.getpid() != self._pid:  # forked: the parent's descriptors stay the parent's
            self._files, self._pid = {}, os.getpid()
        path = self.index.paths[number]
        try:
            fd = self._files.get(number)
            if fd is None:
                fd = self._files[number] = os.open(path, os.O_RDONLY)
            raw = os.pread(fd, size, offset)
        except OSError as exc:
            raise DataError(f"data=shards: cannot read the shard {path}: "
                            f"{exc.strerror or exc}") from None
        if len(raw) != size:
            raise DataError(f"data=shards: the shard {path} is shorter than its index says "
                            f"({offset + len(raw)} of at least {offset + size} bytes): it "
                            "changed or was cut after the run started")
        return raw

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's order: shards shuffled, in blocks of ``block`` shards, each block's
        samples shuffled; a function of (seed, epoch) alone."""
        rng = np.random.default_rng([seed, epoch, 5])
        shard = self.index.shard[self.rows]
        present = np.unique(shard)
        block_of = np.zeros(int(present.max()) + 1 if len(present) else 0, dtype=np.int64)
        block_of[present[rng.permutation(len(present))]] = np.arange(len(present)) // self.block
        return np.lexsort((rng.random(len(shard)), block_of[shard]))

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in getattr(self, "_files", {}).values():
                try:
                    os.close(fd)
                except OSError:
                    pass


class Shards(DataSource):
    """WebDataset tar shards in ``path``: the training shards match ``train``, the
    validation shards ``val`` (none: ``val_fraction`` of the training samples held out,
    fixed ``split_seed``), the test shards ``test`` (none: no test split)."""

    def __init__(self, path: str = "data/shards", train: str = "train*.tar", val: str = "val*.tar",
                 test: str = "test*.tar", input_key: str = "npy", target_key: str = "cls",
                 block: int = 4, val_fraction: float = 0.1, split_seed: int = 0,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 train_transform: Sequence[Any] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if block < 1:
            raise ConfigError(f"data.block={block} must be >= 1 (shards shuffled together)")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        self.path = Path(str(path)).expanduser().absolute()
        self.patterns = {"train": train, "val": val, "test": test}
        self.fields = (input_key, target_key)
        self.block, self.val_fraction, self.split_seed = block, val_fraction, split_seed
        self.mean, self.std = mean, std
        self.train_transform = _instantiate_transforms(train_transform)

    def shards(self, split: str) -> list[Path]:
        pattern = self.patterns[split]
        return sorted(self.path.glob(pattern)) if pattern else []

    def load(self) -> tuple[Dataset, ...]:
        if not self.path.is_dir():
            raise ConfigError(f"data=shards: data.path={self.path} is not a directory of tar "
                              "shards")
        found = {split: self.shards(split) for split in self.patterns}
        if not found["train"]:
            there = sorted(p.name for p in self.path.iterdir())[:8]
            raise ConfigError(f"data=shards: no training shards data.train={self.patterns['train']!r} "
                              f"in {self.path}; there: {', '.join(there) or 'nothing'}")
        indexes = {split: ShardIndex(paths, *self.fields) for split, paths in found.items() if paths}
        train = indexes["train"]
        rows = {"train": np.arange(len(train))}
        if "val" in indexes:
            rows["val"] = np.arange(len(indexes["val"]))
        elif len(train):
            kept, held, _ = split_indices(len(train), self.val_fraction, 0.0, self.split_seed)
            rows["train"], rows["val"] = np.sort(kept), np.sort(held)
        if "test" in indexes:
            rows["test"] = np.arange(len(indexes["test"]))
        parts = []
        for split, chosen in rows.items():
            index = indexes.get(split, train)
            if len(chosen) == 0:
                where = self.patterns[split] if split in indexes else self.patterns["train"]
                raise ConfigError(f"data=shards: the {split} split ({where} in {self.path}) "
                                  "has no samples")
            parts.append(ShardSamples(index, chosen, self.fields, self.block,
                                      self._transform(split == "train")))
        self._describe(parts[0])
        return tuple(parts)

    def _transform(self, train: bool) -> Any:
        steps = list(self.train_transform) if train else []
        if self.mean is not None:
            from torchvision.transforms import Normalize

            steps.append(Normalize(self.mean, self.std))
        if not steps:
            return None
        from torchvision.transforms import Compose

        return Compose(steps)

    def _describe(self, train: ShardSamples) -> None:
        """Shape from the first training sample (its transform applied, the run's random
        streams untouched); classes from the targets' largest integer + 1 (the targets are
        read once, a small member each)."""
        if self.shape is None:
            with torch.random.fork_rng(devices=[]):
                self.shape = tuple(train[0][0].shape)
        if self.num_classes is None and self.fields[1].rsplit(".", 1)[-1] in INTEGERS:
            self.num_classes = max(_targets(train)) + 1

    def data_files(self) -> list[Path]:
        return [p for split in self.patterns for p in self.shards(split)]


def _targets(samples: ShardSamples) -> list[int]:
    """Every sample's integer target, read without decoding the inputs."""
    out = []
    for row in samples.rows:
        number = int(samples.index.shard[row])
        _, _, offset, size = (int(v) for v in samples.index.spans[row])
        out.append(int(samples._read(number, offset, size).decode().strip()))
    return out
