"""``data=hf``: a Hugging Face ``datasets`` dataset, read from local files and memory-mapped
(Apache Arrow): a directory that ``save_to_disk`` wrote, or data files (Parquet, JSON lines,
CSV, Arrow). Nothing is downloaded unless ``data.download=true`` names a Hub dataset.

Each row is one sample: ``data.input_column`` is the input (a column of numbers, or of
fixed-length lists or arrays: one tensor per row), ``data.target_column`` the target (an
integer class or a number). The splits are read by name; a dataset without a validation split
has one held out of its training rows (``data.val_fraction``, fixed ``data.split_seed``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpexp.data.base import DataSource, split_indices
from ddpexp.errors import ConfigError

# data.format's values, and the file endings that imply each.
FORMATS = {"parquet": (".parquet", ".pq"), "json": (".json", ".jsonl"), "csv": (".csv",),
           "arrow": (".arrow",)}


class ArrowRows(Dataset):
    """Rows of a memory-mapped Arrow table as ``(input, target)`` tensors; a batch of indices
    is read in one slice (``__getitems__``, which torch's DataLoader calls)."""

    deterministic = True  # no transform: a row reads the same each time

    def __init__(self, table: Any, input_column: str, target_column: str):
        self.rows = table.with_format("torch", columns=[input_column, target_column])
        self.input_column, self.target_column = input_column, target_column

    def __len__(self) -> int:
        return len(self.rows)

    def _sample(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Arrow's doubles as torch's default float; integer inputs (token ids) stay integers.
        x = x.float() if x.is_floating_point() or x.dtype == torch.bool else x
        return x, y.float() if y.is_floating_point() else y

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[int(i)]
        return self._sample(row[self.input_column], row[self.target_column])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch = self.rows[[int(i) for i in indices]]
        return [self._sample(x, y) for x, y in zip(batch[self.input_column],
                                                   batch[self.target_column], strict=True)]


class HF(DataSource):
    """A Hugging Face dataset: ``path`` (a ``save_to_disk`` directory or one data file) or
    ``data_files`` (a file, or ``{split name: file or files}``), its splits named by
    ``train_split``, ``val_split`` and ``test_split`` (null: none)."""

    def __init__(self, path: str | None = None, data_files: Any = None, format: str | None = None,
                 input_column: str = "x", target_column: str = "y", train_split: str = "train",
                 val_split: str | None = "validation", test_split: str | None = "test",
                 val_fraction: float = 0.1, split_seed: int = 0, download: bool = False,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if (path is None) == (data_files is None):
            raise ConfigError("data=hf: give data.path (a save_to_disk directory or a data file) "
                              "or data.data_files ({split: file}), one of them")
        if format is not None and format not in FORMATS:
            raise ConfigError(f"data.format={format!r} is not one of {', '.join(FORMATS)}")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        self.path = None if path is None else Path(str(path)).expanduser().absolute()
        self.files = _files(data_files) if data_files is not None else None
        self.format, self.download = format, download
        self.input_column, self.target_column = input_column, target_column
        self.splits = {"train": train_split, "val": val_split, "test": test_split}
        self.val_fraction, self.split_seed = val_fraction, split_seed
        self.hub_name = str(path) if download else None

    def data_files(self) -> list[Path]:
        if self.files is not None:
            return [Path(f) for files in self.files.values() for f in files]
        return [self.path] if self.path is not None and not self.download else []

    def load(self) -> tuple[Dataset, ...]:
        splits = self._read()
        train_name = self.splits["train"]
        if train_name not in splits:
            raise ConfigError(f"data=hf: {self._where()} has no split {train_name!r} "
                              f"(data.train_split); its splits: {', '.join(splits) or 'none'}")
        train = splits[train_name]
        self._check_columns(train, train_name)
        val_name, test_name = self.splits["val"], self.splits["test"]
        if val_name is not None and val_name in splits:
            val = splits[val_name]
        else:  # held out of train, by a fixed seed
            kept, held, _ = split_indices(len(train), self.val_fraction, 0.0, self.split_seed)
            train, val = train.select(np.sort(kept)), train.select(np.sort(held))
        parts = {"train": train, "val": val}
        if test_name is not None and test_name in splits:
            parts["test"] = splits[test_name]
        for name, part in parts.items():
            if len(part) == 0:
                raise ConfigError(f"data=hf: the {name} split of {self._where()} is empty")
            self._check_columns(part, name)
        self._describe(train)
        return tuple(ArrowRows(part, self.input_column, self.target_column)
                     for part in parts.values())

    # ------------------------------------------------------------------ reading
    def _read(self) -> dict[str, Any]:
        """The dataset's splits by name, memory-mapped."""
        os.environ.setdefault("HF_DATASETS_OFFLINE", "0" if self.download else "1")
        datasets = datasets_module()
        if self.download:
            return _by_name(datasets.load_dataset(str(self.hub_name)))
        files = self.files
        if files is None:
            path = self.path
            assert path is not None
            if path.is_dir():
                try:
                    loaded = datasets.load_from_disk(str(path))
                except FileNotFoundError as exc:
                    raise ConfigError(f"data=hf: {path} is not a directory that save_to_disk "
                                      f"wrote ({exc})") from None
                except Exception as exc:  # a damaged or empty split: the library's error, named
                    raise ConfigError(f"data=hf: cannot read the save_to_disk directory {path} "
                                      f"({type(exc).__name__}: {exc})") from None
                return _by_name(loaded) if isinstance(loaded, datasets.DatasetDict) \
                    else {self.splits["train"]: loaded}
            if not path.exists():
                raise ConfigError(f"data=hf: data.path={path} does not exist. Give a save_to_disk "
                                  "directory or a data file; a Hub dataset's name downloads only "
                                  "with data.download=true")
            files = {self.splits["train"]: [str(path)]}
        for name in (f for fs in files.values() for f in fs):
            if not Path(name).is_file():
                raise ConfigError(f"data=hf: the data file {name} does not exist")
        builder = self.format or _format_of([f for fs in files.values() for f in fs])
        for split, names in files.items():
            if names and all(_rows(name, builder) == 0 for name in names):
                raise ConfigError(f"data=hf: the {split} split of {self._where()} is empty "
                                  f"(no rows in {', '.join(names)})")
        try:
            return _by_name(datasets.load_dataset(builder, data_files=files))
        except Exception as exc:  # an unreadable file: the library's own error, named
            text = " ".join(str(exc).split())[:300]
            raise ConfigError(f"data=hf: cannot read {self._where()} as {builder} "
                              f"({type(exc).__name__}: {text})") from None

    def _where(self) -> str:
        if self.files is not None:
            return ", ".join(f for fs in self.files.values() for f in fs)
        return str(self.hub_name or self.path)

    def _check_columns(self, part: Any, split: str) -> None:
        present = list(part.column_names)
        for key, column in (("input_column", self.input_column),
                            ("target_column", self.target_column)):
            if column not in present:
                raise ConfigError(f"data.{key}={column!r} is not a column of the {split} split "
                                  f"of {self._where()}; its columns: {', '.join(present)}")

    def _describe(self, train: Any) -> None:
        """``num_classes`` and ``shape`` where the config leaves them null: the target's class
        labels (or its largest value + 1, for integer targets), the first input's shape."""
        first = train.with_format("torch", columns=[self.input_column])[0][self.input_column]
        if self.shape is None:
            self.shape = tuple(first.shape) if first.ndim else (1,)
        if self.num_classes is None:
            feature = train.features[self.target_column]
            names = getattr(feature, "num_classes", None)
            if names is not None:
                self.num_classes = int(names)
            else:
                column = train.with_format("numpy", columns=[self.target_column])[self.target_column]
                if np.issubdtype(np.asarray(column).dtype, np.integer):
                    self.num_classes = int(np.max(column)) + 1


def _files(spec: Any) -> dict[str, list[str]]:
    """``data.data_files`` as {split: [absolute file, ...]}; one file or list is the train split."""
    if isinstance(spec, Mapping):
        items = {str(k): v for k, v in spec.items()}
    else:
        items = {"train": spec}
    return {split: [str(Path(str(f)).expanduser().absolute())
                    for f in ([v] if isinstance(v, (str, Path)) else list(v))]
            for split, v in items.items()}


def datasets_module() -> Any:
    """The ``datasets`` package, its progress bars off and tqdm's monitor thread never
    started (a disabled bar still starts it, and a thread left behind in the process makes
    a later fork unsafe: the sweep's fork server refuses to fork beside one)."""
    import tqdm

    tqdm.tqdm.monitor_interval = 0
    try:
        import datasets
    except ImportError:
        raise ConfigError("data=hf needs the datasets package: pip install 'ddpexp[hf]'") from None
    datasets.disable_progress_bars()
    return datasets


def _by_name(splits: Any) -> dict[str, Any]:
    """A ``DatasetDict``'s splits keyed by their names as strings."""
    return {str(name): part for name, part in splits.items()}


def _rows(name: str, builder: str) -> int | None:
    """How many rows a data file holds, where that is cheap to know (None: not known)."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(name).num_rows
    if builder in ("csv", "json"):
        with open(name, encoding="utf-8", errors="replace") as f:
            lines = sum(1 for line in f if line.strip())
        return max(0, lines - (builder == "csv"))  # a CSV's first line is its header
    return None


def _format_of(files: Sequence[str]) -> str:
    """The builder the files' endings name; one message where they name none or several."""
    found = {fmt for f in files for fmt, ends in FORMATS.items() if f.lower().endswith(ends)}
    if len(found) != 1:
        raise ConfigError(f"data=hf: cannot tell the format of {', '.join(files)} from its "
                          f"ending; set data.format to one of {', '.join(FORMATS)}")
    return found.pop()
