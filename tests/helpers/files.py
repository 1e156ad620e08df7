"""Datasets written in their real file formats (MNIST's idx, CIFAR-10's pickled batches, an
image folder, a text corpus), for the data sources to read."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """An idx file as MNIST ships it: 0x0000, type 0x08 (uint8), ndim, big-endian dims, data."""
    payload = struct.pack(">HBB", 0, 0x08, array.ndim)
    payload += b"".join(struct.pack(">I", d) for d in array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def write_mnist(root: Path, name: str = "MNIST", gz: bool = True, n_train: int = 24,
                n_test: int = 8, size: tuple[int, int] = (28, 28)) -> Path:
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, *size)), gz)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n), gz)
    return raw


def write_cifar10(root: Path, per_batch: int = 4) -> Path:
    """The python version's layout: pickled dicts of a (N, 3072) uint8 array and labels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": f"{name} of 5",
            "labels": rng.integers(0, 10, per_batch).tolist(),
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"img_{k}.png" for k in range(per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
    meta = {"label_names": [f"class{k}" for k in range(10)], "num_cases_per_batch": per_batch}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def write_imagefolder(root: Path, classes=("cat", "dog", "eel"), per_class: int = 3,
                      size: tuple[int, int] = (10, 7), splits=("train", "val")) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in splits:
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for k in range(per_class):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(d / f"{k}.png")
    return root


# A tiny GPT (tied embedding and output weights, dropout, 2 transformer blocks) over the
# corpus that write_corpus() writes, as data.path=text.txt.
TINY_GPT = ["task=lm", "model=gpt", "data=text", "data.path=text.txt", "data.block_size=16",
            "data.train_stride=8", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
            "model.dropout=0.1"]


def write_corpus(path: Path, repeat: int = 40) -> Path:
    """A small text corpus of a few words (``repeat`` times 4 sentences)."""
    path.write_text("".join(f"the {w} sat on the mat. " for w in ("cat", "dog", "bird", "fox") * repeat))
    return path


FEATURES, CLASSES = 6, 3


def rows(n: int, seed: int) -> dict:
    """``n`` rows: 6 features (a list column) and a class that a linear model can learn."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES].argmax(1)).astype(np.int64)
    return {"features": x.tolist(), "label": y.tolist()}


def write_parquet_rows(path: Path, n: int = 240) -> Path:
    """A Parquet file of ``n`` :func:`rows` (the features a fixed-size list column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = rows(n, 0)
    table = pa.table({"features": pa.array(data["features"], pa.list_(pa.float32(), FEATURES)),
                      "label": pa.array(data["label"], pa.int64())})
    pq.write_table(table, path)
    return path


ID_SCALE = 1024.0  # a sample's id is its first feature times this (exact in float32)


def write_shards(root: Path, shards: int = 6, per_shard: int = 16, prefix: str = "train",
                 first_id: int = 0, images: bool = False) -> Path:
    """WebDataset tar shards ``prefix-000.tar``, ... in ``root``, written with the tarfile
    module: sample ``k`` is ``{k:06d}.npy`` (the :func:`rows` features, the first replaced
    by ``k / ID_SCALE``, so that a model's input says which sample it is) and
    ``{k:06d}.cls``; ``images``: ``{k:06d}.png`` (a 3x12x12 RGB image) instead of the npy."""
    import io
    import tarfile

    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    data = rows(shards * per_shard, first_id + 7)
    rng = np.random.default_rng(first_id)
    for s in range(shards):
        with tarfile.open(root / f"{prefix}-{s:03d}.tar", "w") as tar:
            for j in range(per_shard):
                k = s * per_shard + j
                sid = first_id + k
                label = int(data["label"][k])
                if images:
                    pixels = rng.integers(0, 60, size=(12, 12, 3), dtype=np.uint8)
                    pixels[..., label] += 150  # the class is the brightest channel
                    buf = io.BytesIO()
                    Image.fromarray(pixels).save(buf, format="PNG")
                    members = {"png": buf.getvalue()}
                else:
                    x = np.asarray(data["features"][k], dtype=np.float32)
                    x[0] = sid / ID_SCALE
                    buf = io.BytesIO()
                    np.save(buf, x)
                    members = {"npy": buf.getvalue()}
                members["cls"] = str(label).encode()
                for field, raw in members.items():
                    info = tarfile.TarInfo(f"{sid:06d}.{field}")
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return root
