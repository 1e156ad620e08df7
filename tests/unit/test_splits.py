"""Train, validation and test splits of every built-in data option: no sample in two splits,
every sample in one, the official test files kept as the test set, stratified and seeded
hold-outs. The file-based options read files written in their real on-disk formats."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_cifar10, write_imagefolder, write_mnist
from torch.utils.data import Subset


def sample_keys(dataset) -> list:
    """One hashable key per sample: the bytes of an in-memory sample, the file of an image."""
    if isinstance(dataset, Subset):
        return [dataset.dataset.samples[i][0] for i in dataset.indices]
    if hasattr(dataset, "samples"):
        return [path for path, _ in dataset.samples]
    return [dataset.x[i].numpy().tobytes() for i in range(len(dataset))]


def assert_disjoint(*parts) -> list[set]:
    """No sample in two parts, none twice in one; returns each part's keys."""
    keys = [sample_keys(p) for p in parts]
    sets = [set(k) for k in keys]
    for k, s in zip(keys, sets, strict=False):
        assert len(k) == len(s) > 0
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            assert not sets[i] & sets[j], (i, j)
    return sets


def labels_of(dataset) -> np.ndarray:
    return dataset.y.numpy()


def assert_stratified(train, val) -> None:
    """Each class's share of the validation set is its share of the training files, to the
    rounding of one sample."""
    tr, va = Counter(labels_of(train).tolist()), Counter(labels_of(val).tolist())
    frac = len(labels_of(val)) / (len(labels_of(train)) + len(labels_of(val)))
    for c in tr.keys() | va.keys():
        assert abs(va[c] - frac * (tr[c] + va[c])) <= 1, (c, tr[c], va[c])


def test_digits_three_way_split_is_disjoint_stratified_and_seeded():
    from sklearn.datasets import load_digits

    from ddpexp.data import Digits

    train, val, test = Digits().load()
    assert_disjoint(train, val, test)
    assert (len(train), len(val), len(test)) == (1437, 180, 180)
    assert len(train) + len(val) + len(test) == len(load_digits().target)
    assert_stratified(train, val)
    again = Digits().load()
    assert all(torch.equal(a.x, b.x) for a, b in zip((train, val, test), again, strict=False))
    other = Digits(split_seed=1).load()
    assert not torch.equal(other[2].y, test.y) or not torch.equal(other[2].x, test.x)
    # test_fraction=0: a run without a test split.
    assert len(Digits(test_fraction=0.0).load()) == 2


def test_split_fractions_are_checked():
    from ddpexp.data import Digits
    from ddpexp.errors import ConfigError

    with pytest.raises(ConfigError, match="data.val_fraction=0.6 and data.test_fraction=0.5"):
        Digits(val_fraction=0.6, test_fraction=0.5).load()
    with pytest.raises(ConfigError, match=r"data.val_fraction=1.5 must be in \[0, 1\)"):
        Digits(val_fraction=1.5).load()


def test_synthetic_three_independent_draws():
    from ddpexp.data import Synthetic

    source = Synthetic(num_samples=64, val_samples=16, test_samples=24, shape=[3, 2],
                       num_classes=4)
    train, val, test = source.load()
    assert (len(train), len(val), len(test)) == (64, 16, 24)
    assert_disjoint(train, val, test)
    assert len(Synthetic(test_samples=0, shape=[2], num_classes=2).load()) == 2


@pytest.mark.parametrize("name,cls", [("MNIST", "MNIST"), ("FashionMNIST", "FashionMNIST")])
def test_mnist_val_from_training_files_test_from_test_files(tmp_path, name, cls):
    import ddpexp.data
    from ddpexp.data import read_idx

    raw = write_mnist(tmp_path, name=name, gz=name == "MNIST", n_train=200, n_test=30)
    source = getattr(ddpexp.data, cls)(root=str(tmp_path), shape=[1, 28, 28])
    train, val, test = source.load()
    keys = assert_disjoint(train, val, test)
    assert (len(train), len(val), len(test)) == (180, 20, 30)
    # Test is exactly the test files; train and val together exactly the training files.
    suffix = ".gz" if name == "MNIST" else ""
    files = {split: read_idx(raw / f"{split}-images-idx3-ubyte{suffix}").unsqueeze(1).float() / 255
             for split in ("train", "t10k")}
    as_keys = lambda x: {x[i].numpy().tobytes() for i in range(len(x))}
    assert keys[2] == as_keys(files["t10k"])
    assert keys[0] | keys[1] == as_keys(files["train"])
    assert_stratified(train, val)
    # Another split_seed holds out other samples; the test set stays the test files.
    other = getattr(ddpexp.data, cls)(root=str(tmp_path), shape=[1, 28, 28], split_seed=3).load()
    assert set(sample_keys(other[1])) != keys[1] and set(sample_keys(other[2])) == keys[2]


def test_cifar10_val_from_data_batches_test_from_test_batch(tmp_path):
    import pickle

    from ddpexp.data import CIFAR10

    folder = write_cifar10(tmp_path, per_batch=20)
    train, val, test = CIFAR10(root=str(tmp_path), verify=False, val_fraction=0.2,
                               train_transform=None).load()
    keys = assert_disjoint(train, val, test)
    assert (len(train), len(val), len(test)) == (80, 20, 20)
    entry = pickle.loads((folder / "test_batch").read_bytes())
    assert Counter(labels_of(test).tolist()) == Counter(entry["labels"])
    assert len(keys[0] | keys[1]) == 100


def test_cifar10_train_transform_only_on_train(tmp_path):
    from ddpexp.data import CIFAR10

    write_cifar10(tmp_path, per_batch=4)
    train, val, test = CIFAR10(root=str(tmp_path), verify=False, mean=[0.5] * 3, std=[0.5] * 3,
                               train_transform=[{"_target_": "torchvision.transforms.RandomHorizontalFlip"}]
                               ).load()
    assert train.transform is not None and val.transform is None and test.transform is None
    assert len(train) + len(val) == 20 and len(test) == 4


def test_imagefolder_holds_val_out_of_train_and_reads_test(tmp_path):
    from ddpexp.data import ImageFolder

    write_imagefolder(tmp_path, per_class=10, splits=("train", "test"))
    flip = [{"_target_": "torchvision.transforms.RandomHorizontalFlip"}]
    train, val, test = ImageFolder(root=str(tmp_path), shape=[3, 4, 4], val_fraction=0.2,
                                   train_transform=flip).load()
    keys = assert_disjoint(train, val, test)
    assert (len(train), len(val), len(test)) == (24, 6, 30)
    assert all("/train/" in k for k in keys[0] | keys[1]) and all("/test/" in k for k in keys[2])
    assert Counter(val.dataset.targets[i] for i in val.indices) == {0: 2, 1: 2, 2: 2}
    # The held-out images are read without the train transform.
    assert "RandomHorizontalFlip" in repr(train.dataset.transform)
    assert "RandomHorizontalFlip" not in repr(val.dataset.transform)


def test_imagefolder_with_val_and_test_folders(tmp_path):
    from ddpexp.data import ImageFolder
    from ddpexp.errors import ConfigError

    write_imagefolder(tmp_path, splits=("train", "val", "test"))
    train, val, test = ImageFolder(root=str(tmp_path), shape=[1, 4, 4]).load()
    keys = assert_disjoint(train, val, test)
    assert [{Path(k).parts[-3] for k in s} for s in keys] == [{"train"}, {"val"}, {"test"}]
    (tmp_path / "test" / "fox").mkdir()
    (tmp_path / "test" / "cat" / "0.png").rename(tmp_path / "test" / "fox" / "0.png")
    with pytest.raises(ConfigError, match="differ from test classes"):
        ImageFolder(root=str(tmp_path), shape=[1, 4, 4]).load()


def test_imagefolder_without_test_folder_has_no_test_split(tmp_path):
    from ddpexp.data import ImageFolder

    write_imagefolder(tmp_path)
    assert len(ImageFolder(root=str(tmp_path), shape=[1, 4, 4]).load()) == 2


def test_diabetes_three_way_split():
    from ddpexp.data import Diabetes

    train, val, test = Diabetes().load()
    assert_disjoint(train, val, test)
    assert len(train) + len(val) + len(test) == 442 and len(test) == 45


def test_text_parts_share_no_token(tmp_path):
    """A text's windows are views of one token tensor: the token positions each part's
    windows (inputs and targets) cover never overlap, even where the text repeats itself."""
    from ddpexp.data import Text

    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat. " * 40)
    parts = Text(path=str(path), block_size=8, train_stride=3).load()
    assert len(parts) == 3

    def positions(part) -> set:
        return {p for i in range(len(part)) for p in
                range(part.x[i].storage_offset(), part.x[i].storage_offset() + 9)}

    covered = [positions(p) for p in parts]
    assert all(covered) and not (covered[0] & covered[1] or covered[1] & covered[2]
                                 or covered[0] & covered[2])
    assert max(covered[0]) < min(covered[1]) and max(covered[1]) < min(covered[2])


def test_packaged_digits_and_diabetes_are_scikit_learns_numbers_bit_for_bit():
    """The files are read without importing scikit-learn; what comes out is what its loaders
    give, so a run's data (and every saved run's resume) is unchanged."""
    import numpy as np
    from sklearn.datasets import load_diabetes, load_digits

    from ddpexp.data.sources import _packaged, _scaled, csv_table

    table = csv_table(_packaged("digits.csv.gz"))
    assert table.dtype == np.float64
    digits = load_digits()
    assert np.array_equal(table[:, :-1].reshape(-1, 8, 8), digits.images)
    assert np.array_equal(table[:, -1].astype(int), digits.target)
    diabetes = load_diabetes()
    assert np.array_equal(_scaled(np.loadtxt(_packaged("diabetes_data_raw.csv.gz"))), diabetes.data)
    assert np.array_equal(np.loadtxt(_packaged("diabetes_target.csv.gz")), diabetes.target)


@pytest.mark.parametrize("text", [
    "0,7,16\n3,100,9\n",  # up to three digits a field
    "1,2\n3,4",  # no newline at the end
    "0.5,1\n2,3\n",  # not integers: loadtxt's
    "-1,2\n3,4\n",
    "12345,6\n7,8\n",
])
def test_a_gzipped_csv_table_reads_as_loadtxt_reads_it(tmp_path, text):
    import gzip

    from ddpexp.data.sources import csv_table

    path = tmp_path / "table.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    table = csv_table(path)
    assert table.dtype == np.float64
    assert np.array_equal(table, np.loadtxt(path, delimiter=","))


def test_a_ragged_csv_table_is_refused_as_loadtxt_refuses_it(tmp_path):
    import gzip

    from ddpexp.data.sources import csv_table

    path = tmp_path / "table.csv.gz"
    path.write_bytes(gzip.compress(b"1,2,3\n4,5\n6\n"))
    with pytest.raises(ValueError):
        csv_table(path)


@pytest.mark.parametrize("n,fraction,classes,skew", [
    (1797, 0.1, 10, False), (1617, 0.1 / 0.9, 10, False), (442, 0.1, 0, False),
    (100, 0.33, 3, True), (37, 0.2, 5, False), (12, 0.5, 6, False), (50, 0.1, 7, True),
])
def test_the_split_draws_what_scikit_learns_train_test_split_draws(n, fraction, classes, skew):
    import numpy as np
    from sklearn.model_selection import train_test_split

    from ddpexp.data.base import _two_way

    gen = np.random.default_rng(n)
    index = gen.permutation(n * 3)[:n]
    labels = None
    if classes:
        p = np.linspace(1, 4, classes) if skew else np.ones(classes)
        labels = gen.choice(classes, size=n, p=p / p.sum())
    held = int(np.ceil(fraction * n))
    for seed in (0, 1, 7, 12345):
        kept, held_out = _two_way(index, fraction, seed, labels)
        stratify = labels
        if labels is not None:
            counts = np.unique(labels, return_counts=True)[1]
            if counts.min() < 2 or held < len(counts) or n - held < len(counts):
                stratify = None
        want_kept, want_held = train_test_split(index, test_size=held, random_state=seed,
                                                stratify=stratify)
        assert np.array_equal(kept, want_kept) and np.array_equal(held_out, want_held)


def test_digits_and_diabetes_load_without_importing_scikit_learn(monkeypatch):
    """scikit-learn's import (scipy, pandas) costs every worker about a second: the packaged
    data must load without it (its modules are taken out of sys.modules for the test, and put
    back after it)."""
    import sys

    from ddpexp.data import Diabetes, Digits

    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    assert [len(p) for p in Digits().load()] == [1437, 180, 180]
    assert [len(p) for p in Diabetes().load()] == [352, 45, 45]
    assert not [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]
