"""The data sources the ``data`` config group names: scikit-learn's digits and diabetes,
synthetic tensors, MNIST, Fashion-MNIST and CIFAR-10 from their own files, an image folder, a
text file of characters."""

from __future__ import annotations

import gzip
import itertools
import pickle
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpexp.data.base import DataSource, InMemory, _two_way, split_indices
from ddpexp.errors import ConfigError


class Digits(DataSource):
    """scikit-learn's handwritten digits, split three ways (stratified, ``split_seed``) and
    standardised with the training split's statistics."""

    ships_with = "scikit-learn"

    def __init__(self, val_fraction: float = 0.1, test_fraction: float = 0.1, split_seed: int = 0,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.split_seed = split_seed

    def load(self) -> tuple[InMemory, ...]:
        table = csv_table(_packaged("digits.csv.gz"))
        target = table[:, -1].astype(int)
        x = torch.tensor(table[:, :-1].reshape(-1, 8, 8), dtype=torch.float32).unsqueeze(1)
        y = torch.tensor(target, dtype=torch.long)
        parts = [torch.as_tensor(p) for p in split_indices(
            len(y), self.val_fraction, self.test_fraction, self.split_seed, target)]
        mean, std = x[parts[0]].mean(), x[parts[0]].std()
        x = (x - mean) / std
        return _present(InMemory(x[i], y[i]) for i in parts)


def csv_table(path: Path) -> np.ndarray:
    """The gzipped CSV at ``path`` as ``np.loadtxt(path, delimiter=",")`` reads it (float64).
    A table of small non-negative integers (up to 3 digits, the digits file's 0-16) is parsed
    in a few vectorised passes over its bytes, 5-8x faster than ``loadtxt``: a sweep's every
    job reads it. Anything else goes to ``loadtxt``."""
    raw = gzip.decompress(path.read_bytes())
    if raw and not raw.endswith(b"\n"):
        raw += b"\n"
    chars = np.frombuffer(raw, dtype=np.uint8)
    sep = (chars == ord(",")) | (chars == ord("\n"))
    ends = np.flatnonzero(sep)
    width = np.diff(ends, prepend=-1) - 1  # each field's characters
    fields = np.diff(np.flatnonzero(chars[ends] == ord("\n")), prepend=-1)  # each row's
    digit = (chars >= ord("0")) & (chars <= ord("9"))
    if (not len(ends) or not (sep | digit).all() or width.min() < 1 or width.max() > 3
            or (fields != fields[0]).any()):
        return np.loadtxt(path, delimiter=",")
    d = chars.astype(np.int64) - ord("0")
    values = d[ends - 1]
    for place in (1, 2):  # the tens, then the hundreds, where a field has them
        wide = width > place
        values[wide] += 10**place * d[ends[wide] - 1 - place]
    return values.reshape(len(fields), -1).astype(np.float64)


def _packaged(name: str) -> Path:
    """A data file that ships inside scikit-learn (``sklearn/datasets/data``), found without
    importing scikit-learn: its import (scipy, pandas) would cost every worker a second."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the {name} data ships with scikit-learn, which is not installed: "
                          "pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / name
    if not path.is_file():
        raise ConfigError(f"scikit-learn's data file {path} is missing; reinstall scikit-learn")
    return path


def _scaled(x: np.ndarray) -> np.ndarray:
    """Diabetes features as scikit-learn's ``load_diabetes()`` gives them: each column
    centred and divided by its standard deviation (the steps of ``sklearn.preprocessing.scale``,
    its corrections included, so that the numbers match bit for bit), then by sqrt(n_samples)."""
    mean, std = np.nanmean(x, axis=0), np.nanstd(x, axis=0)
    x = x - mean
    drift = np.nanmean(x, axis=0)
    if not np.allclose(drift, 0):
        x -= drift
    x /= np.where(std < 10 * np.finfo(std.dtype).eps, 1.0, std)
    drift = np.nanmean(x, axis=0)
    if not np.allclose(drift, 0):
        x -= drift
    x /= x.shape[0] ** 0.5
    return x


def _present(parts: Iterable[InMemory]) -> tuple[InMemory, ...]:
    """``(train, val, test)``, or ``(train, val)`` where ``test_fraction=0`` left test empty."""
    parts = tuple(parts)
    return parts if len(parts[2]) else parts[:2]


class Synthetic(DataSource):
    """Learnable data of any shape: class prototypes plus Gaussian noise, from a fixed seed.
    Train, val and test are independent draws (``test_samples=0``: no test split)."""

    def __init__(
        self,
        num_samples: int = 2048,
        val_samples: int = 512,
        test_samples: int = 512,
        noise: float = 1.0,
        data_seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if self.shape is None or self.num_classes is None:
            raise ConfigError("data=synthetic needs data.shape and data.num_classes")
        if num_samples < 1 or val_samples < 1 or test_samples < 0:
            raise ConfigError("data.num_samples and data.val_samples must be >= 1, "
                              "data.test_samples >= 0")
        self.num_samples, self.val_samples, self.test_samples = num_samples, val_samples, test_samples
        self.noise, self.data_seed = noise, data_seed

    def load(self) -> tuple[InMemory, ...]:
        g = torch.Generator().manual_seed(self.data_seed)
        # Both are checked in __init__.
        classes, shape = cast(int, self.num_classes), cast(tuple[int, ...], self.shape)
        prototypes = torch.randn((classes, *shape), generator=g)

        def make(n: int) -> InMemory:
            y = torch.randint(0, classes, (n,), generator=g)
            # Built in place in the noise tensor, a chunk at a time: the peak is one copy of
            # the data set, where `prototypes[y] + noise * randn` held three at once.
            x = torch.randn((n, *shape), generator=g).mul_(self.noise)
            for start in range(0, n, 4096):
                x[start : start + 4096] += prototypes[y[start : start + 4096]]
            return InMemory(x, y)

        # Drawn in this order, so train and val stay what they were before test existed.
        return _present(iter([make(self.num_samples), make(self.val_samples),
                              make(self.test_samples)]))


def _instantiate_transforms(specs: Sequence[Any] | None) -> list:
    if not specs:
        return []
    from hydra.utils import instantiate

    return [instantiate(s) if isinstance(s, dict) else s for s in specs]


class _TorchvisionSource(DataSource):
    """Shared parts of the file-based datasets: root, download, normalisation, transforms,
    and the validation set held out of the training files (``val_fraction``, stratified by
    class, ``split_seed``), so that the official test files stay unseen until the test."""

    def __init__(
        self,
        root: str = "data",
        download: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        train_transform: Sequence[Any] | None = None,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be between 0 and 1 "
                              "(the share of the training files held out for validation)")
        self.val_fraction, self.split_seed = val_fraction, split_seed
        # Absolute, so that messages say exactly where the files were looked for.
        self.root = Path(str(root)).expanduser().absolute()
        self.download = download
        self.mean, self.std = mean, std
        self.train_transform = _instantiate_transforms(train_transform)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return x
        shape = (1, -1) + (1,) * (x.dim() - 2)
        mean = torch.tensor(self.mean, dtype=x.dtype).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype).view(shape)
        return (x - mean) / std

    def _in_memory(self, images: torch.Tensor, labels: Any, train: bool) -> InMemory:
        """uint8 NHW or NHWC images -> float NCHW tensors in [0, 1] held in memory.

        Without a train transform the whole tensor is normalised once (and batched by the
        fast path). With one, the transform sees [0, 1] images, as torchvision's transforms
        expect (a RandomCrop pads with black, not with the mean), and normalisation follows
        it per sample."""
        x = images if images.dim() == 4 else images.unsqueeze(-1)
        x = x.permute(0, 3, 1, 2).float().div_(255)
        y = torch.as_tensor(labels, dtype=torch.long)
        if not (train and self.train_transform):
            return InMemory(self._normalize(x).contiguous(), y)
        from torchvision.transforms import Compose, Normalize

        steps = list(self.train_transform)
        if self.mean is not None:
            steps.append(Normalize(self.mean, self.std))
        return InMemory(x.contiguous(), y, Compose(steps))

    def _hold_out(self, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of the training files' samples kept for training and held out for
        validation."""
        labels = np.asarray(labels)
        train, val = _two_way(np.arange(len(labels)), self.val_fraction, self.split_seed, labels)
        return torch.as_tensor(np.sort(train)), torch.as_tensor(np.sort(val))

    def _three_way(self, images: torch.Tensor, labels: Any, test_images: torch.Tensor,
                   test_labels: Any) -> tuple[InMemory, InMemory, InMemory]:
        """Train and val from the training files, test from the test files."""
        labels = torch.as_tensor(labels, dtype=torch.long)
        tr, va = self._hold_out(labels.numpy())
        return (self._in_memory(images[tr], labels[tr], train=True),
                self._in_memory(images[va], labels[va], train=False),
                self._in_memory(test_images, test_labels, train=False))

    def _fetch(self, dataset_cls: Any) -> None:
        """``data.download=true``: let torchvision fetch the files (only then, never implicitly)."""
        if not self.download:
            return
        try:
            for train in (True, False):
                dataset_cls(str(self.root), train=train, download=True)
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"data.download=true could not fetch {dataset_cls.__name__} into {self.root}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}. "
                "Download the files elsewhere and copy them there."
            ) from None


def read_idx(path: Path) -> torch.Tensor:
    """One idx file (the MNIST format: big-endian magic, dims, then the array), gzipped or
    not. Read here rather than by torchvision, which only opens uncompressed files."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ConfigError(f"{path} is not an idx file (bad magic number)")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ConfigError(f"{path} is not an idx file (unknown type code {raw[2]:#x})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * k : 8 + 4 * k], "big") for k in range(ndim)]
    offset = 4 + 4 * ndim
    dtype = np.dtype(dtypes[raw[2]])
    count = int(np.prod(dims)) if dims else 1
    if len(raw) - offset != count * dtype.itemsize:
        raise ConfigError(f"{path}: header says {dims} but the file holds a different size")
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(dims)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("=")).copy())


class MNIST(_TorchvisionSource):
    """MNIST from the idx files in ``root/MNIST/raw`` (gzipped or not)."""

    dataset_name = "MNIST"
    files = {
        True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }

    def data_files(self) -> list[Path]:
        return [self.root / self.dataset_name / "raw"]

    def _find(self, raw: Path, name: str) -> Path | None:
        for candidate in (raw / name, raw / f"{name}.gz"):
            if candidate.is_file():
                return candidate
        return None

    def load(self) -> tuple[InMemory, InMemory, InMemory]:
        import torchvision.datasets as tvd

        self._fetch(getattr(tvd, self.dataset_name))
        raw = self.root / self.dataset_name / "raw"
        names = [n for split in (True, False) for n in self.files[split]]
        missing = [n for n in names if self._find(raw, n) is None]
        if missing:
            raise ConfigError(
                f"data={self.dataset_name.lower()}: {len(missing)} of its files are missing from "
                f"{raw}. Put {', '.join(names)} there (each plain or gzipped as .gz), point "
                f"data.root at the folder that holds {self.dataset_name}/raw, or add "
                "data.download=true where a network is reachable."
            )
        out = []
        for split in (True, False):
            # Every file was found above.
            images, labels = (read_idx(cast(Path, self._find(raw, n))) for n in self.files[split])
            if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
                raise ConfigError(
                    f"data={self.dataset_name.lower()}: {raw}/{self.files[split][0]} holds "
                    f"{list(images.shape)} images for {list(labels.shape)} labels"
                )
            if self.shape is not None and tuple(self.shape) != (1, *images.shape[1:]):
                raise ConfigError(
                    f"data.shape={list(self.shape)} but {raw} holds {images.shape[1]}x"
                    f"{images.shape[2]} grey images: set data.shape=[1,{images.shape[1]},"
                    f"{images.shape[2]}]"
                )
            out.append((images, labels.long()))
        return self._three_way(*out[0], *out[1])


class FashionMNIST(MNIST):
    """Fashion-MNIST from the idx files in ``root/FashionMNIST/raw`` (gzipped or not)."""

    dataset_name = "FashionMNIST"


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch (a dict of bytes, lists and numpy arrays) and nothing else: a
    batch file is a pickle, and an arbitrary pickle can run code when loaded."""

    ALLOWED = {
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module, name)


class CIFAR10(_TorchvisionSource):
    """CIFAR-10 from the python batches in ``root/cifar-10-batches-py``.

    Each batch's MD5 is checked against the official release; ``verify=false`` skips that
    check for files you made yourself (the tests do). Either way the files are unpickled by a
    restricted unpickler that only builds numpy arrays, lists and dicts.
    """

    def __init__(self, verify: bool = True, **kwargs: Any):
        super().__init__(**kwargs)
        self.verify = verify

    def data_files(self) -> list[Path]:
        return [self.root / "cifar-10-batches-py"]

    def _read(self, path: Path, md5: str) -> tuple[np.ndarray, list]:
        from torchvision.datasets.utils import check_integrity

        if self.verify and not check_integrity(str(path), md5):
            raise ConfigError(
                f"data=cifar10: {path} is not the official CIFAR-10 file (MD5 mismatch). Replace "
                "it with the official one, or add data.verify=false for files you made yourself."
            )
        try:
            with open(path, "rb") as f:
                entry = _BatchUnpickler(f, encoding="latin1").load()
            data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = list(entry["labels"] if "labels" in entry else entry["fine_labels"])
        except (pickle.UnpicklingError, KeyError, ValueError, TypeError, EOFError) as exc:
            raise ConfigError(f"data=cifar10: {path} is not a CIFAR-10 python batch ({exc})") from None
        if len(labels) != len(data):
            raise ConfigError(f"data=cifar10: {path} holds {len(data)} images, {len(labels)} labels")
        return data, labels

    def load(self) -> tuple[InMemory, InMemory, InMemory]:
        import torchvision.datasets as tvd

        self._fetch(tvd.CIFAR10)
        folder = self.root / tvd.CIFAR10.base_folder
        missing = [n for n, _ in tvd.CIFAR10.train_list + tvd.CIFAR10.test_list
                   if not (folder / n).is_file()]
        if missing:
            raise ConfigError(
                f"data=cifar10: {', '.join(missing)} not found in {folder}. Put the python "
                "version's data_batch_1..5 and test_batch there (set data.root to the folder "
                "that holds cifar-10-batches-py), or add data.download=true where a network "
                "is reachable."
            )
        out = []
        for files in (tvd.CIFAR10.train_list, tvd.CIFAR10.test_list):
            parts = [self._read(folder / name, md5) for name, md5 in files]
            images = torch.from_numpy(np.concatenate([d for d, _ in parts])).permute(0, 2, 3, 1)
            labels = [label for _, ls in parts for label in ls]
            out.append((images, labels))
        return self._three_way(*out[0], *out[1])


class ImageFolder(_TorchvisionSource):
    """Images in ``root/train/<class>/``, read as they are needed. Validation is
    ``root/val/<class>/`` where that folder exists, else held out of ``root/train``
    (``val_fraction``, stratified); test is ``root/test/<class>/`` where it exists."""

    def load(self) -> tuple[Dataset, ...]:
        from torch.utils.data import Subset
        from torchvision import transforms

        if not (self.root / "train").is_dir():
            raise ConfigError(
                f"data=imagefolder: {self.root / 'train'} does not exist. Lay the images out "
                f"as {self.root}/train/<class>/*.png, and optionally {self.root}/val/<class>/ "
                f"and {self.root}/test/<class>/ (without val/, data.val_fraction of train/ "
                "is held out for validation)."
            )
        if self.shape is None:
            raise ConfigError("data=imagefolder needs data.shape=[C,H,W]")
        channels, size = self.shape[0], list(self.shape[1:])
        common: list[Any] = [transforms.Resize(size)]
        if channels == 1:
            common.append(transforms.Grayscale(1))
        tail: list[Any] = [transforms.ToTensor()]
        if self.mean is not None:
            tail.append(transforms.Normalize(self.mean, self.std))
        plain = transforms.Compose(common + tail)
        train = self._folder("train", transforms.Compose(common + self.train_transform + tail))
        if (self.root / "val").is_dir():
            val: Dataset = self._folder("val", plain, train.classes)
        else:
            # The same files twice, so the held-out part is read without the train transform.
            kept, held = self._hold_out(train.targets)
            val = Subset(self._folder("train", plain), held.tolist())
            train = Subset(train, kept.tolist())
        test = self._folder("test", plain, self._classes) if (self.root / "test").is_dir() else None
        if self.num_classes is None:
            self.num_classes = len(self._classes)
        elif self.num_classes != len(self._classes):
            raise ConfigError(
                f"data.num_classes={self.num_classes} but {self.root}/train has "
                f"{len(self._classes)} class folders"
            )
        return (train, val) if test is None else (train, val, test)

    def _folder(self, split: str, transform: Any, classes: list | None = None):
        """torchvision's ImageFolder over ``root/split``; its class folders must be those of
        ``root/train`` (else a label would mean another class)."""
        from torchvision import datasets

        try:
            folder = datasets.ImageFolder(str(self.root / split), transform,
                                          loader=_ImageLoader(cast(tuple[int, ...], self.shape)[0]))
        except (FileNotFoundError, RuntimeError) as exc:
            raise ConfigError(f"data=imagefolder: {exc}") from None
        if classes is None:
            self._classes = folder.classes
        elif folder.classes != classes:
            raise ConfigError(
                f"data=imagefolder: train classes {classes} differ from {split} classes "
                f"{folder.classes}"
            )
        return folder


class _ImageLoader:
    """Opens an image file as grey or RGB (a class, so DataLoader workers can pickle it)."""

    def __init__(self, channels: int):
        self.mode = "L" if channels == 1 else "RGB"

    def __call__(self, path: str):
        from PIL import Image

        with open(path, "rb") as f:
            return Image.open(f).convert(self.mode)


class Diabetes(DataSource):
    """scikit-learn's diabetes data (442 patients x 10 features, a disease-progression target),
    features and target standardised with the training split's statistics."""

    ships_with = "scikit-learn"

    def __init__(self, val_fraction: float = 0.1, test_fraction: float = 0.1, split_seed: int = 0,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.split_seed = split_seed

    def load(self) -> tuple[InMemory, ...]:
        x = torch.tensor(_scaled(np.loadtxt(_packaged("diabetes_data_raw.csv.gz"))),
                         dtype=torch.float32)
        y = torch.tensor(np.loadtxt(_packaged("diabetes_target.csv.gz")), dtype=torch.float32)
        parts = split_indices(len(y), self.val_fraction, self.test_fraction, self.split_seed)
        tr = torch.as_tensor(parts[0])
        x = (x - x[tr].mean(0)) / x[tr].std(0)
        y = (y - y[tr].mean()) / y[tr].std()
        return _present(InMemory(x[i], y[i]) for i in map(torch.as_tensor, parts))


class Text(DataSource):
    """A UTF-8 text file for next-token prediction, read as characters (``encoding=char``,
    the vocabulary is the file's characters) or bytes (``encoding=bytes``, 256 symbols).

    The token stream is cut into three contiguous parts (train, then val, then test), so no
    window crosses from one part into another. Samples are ``block_size`` windows of
    ``(tokens, next tokens)``: every ``train_stride`` positions in train, non-overlapping in
    val and test. Windows are views of the one token tensor, never copies."""

    def __init__(self, path: str, block_size: int = 64, encoding: str = "char",
                 train_stride: int = 1, val_fraction: float = 0.1, test_fraction: float = 0.1,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if encoding not in ("char", "bytes"):
            raise ConfigError(f"data.encoding={encoding!r} is not one of char, bytes")
        if block_size < 1 or train_stride < 1:
            raise ConfigError("data.block_size and data.train_stride must be >= 1")
        if not 0.0 < val_fraction < 1.0 or not 0.0 <= test_fraction < 1.0 \
                or val_fraction + test_fraction >= 1.0:
            raise ConfigError(
                f"data.val_fraction={val_fraction}, data.test_fraction={test_fraction}: each in "
                "[0, 1), validation above 0, both together below 1"
            )
        self.path = Path(str(path)).expanduser().absolute()
        self.block_size, self.encoding, self.train_stride = block_size, encoding, train_stride
        self.val_fraction, self.test_fraction = val_fraction, test_fraction

    def _tokens(self) -> torch.Tensor:
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"data=text: cannot read data.path={self.path} ({exc.strerror}). "
                              "Point data.path at a UTF-8 text file") from None
        if self.encoding == "bytes":
            self.num_classes = 256
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"data=text: {self.path} is not UTF-8 ({exc.reason} at byte "
                              f"{exc.start}); use data.encoding=bytes") from None
        self.vocab = sorted(set(text))
        self.num_classes = len(self.vocab)
        lookup = {ch: i for i, ch in enumerate(self.vocab)}
        return torch.tensor([lookup[ch] for ch in text], dtype=torch.long)

    def load(self) -> tuple[InMemory, ...]:
        tokens = self._tokens()
        n, t = len(tokens), self.block_size
        n_test = int(n * self.test_fraction)
        n_val = int(n * self.val_fraction)
        bounds = [0, n - n_val - n_test, n - n_test, n]
        strides = [self.train_stride, t, t]
        parts = []
        for (lo, hi), stride, name in zip(itertools.pairwise(bounds), strides, ("train", "val", "test"), strict=True):
            if hi - lo < t + 1 and not (name == "test" and hi == lo):
                raise ConfigError(
                    f"data=text: the {name} part of {self.path} has {hi - lo} tokens, fewer than "
                    f"data.block_size+1={t + 1}; use a longer file or a smaller data.block_size"
                )
            windows = tokens[lo:hi].unfold(0, t + 1, stride) if hi - lo > t else tokens.new_zeros((0, t + 1))
            parts.append(InMemory(windows[:, :-1], windows[:, 1:]))
        return tuple(parts) if n_test else tuple(parts[:2])
