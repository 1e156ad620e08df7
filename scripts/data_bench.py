"""The data cases of scripts/bench.py (``--cases data``).

Readers: one epoch of the same PNG images (3x32x32, 8 shards) read and decoded by the
streaming readers considered for ``data=shards``, at 0 and 2 loader workers: ddpexp's own
(WebDataset tar shards, indexed, read by sample in the epoch's block-shuffled order), the
``webdataset`` library (sequential tar reads, a shuffle buffer) and a Hugging Face
``IterableDataset`` over Parquet shards (a shuffle buffer), each where it is importable;
and what each does when an epoch is cut after 40% and resumed (lost and repeated samples).

Loader: samples/s of the training loop (one process, a convnet, batch 64) on the same
images as pre-loaded tensors (``data=cifar10`` without a transform: batched by indexing),
as pre-loaded tensors with random crops and flips in 2 loader workers, and as ``data=shards``
with the same augmentation in 2 loader workers: whether the loop waits for its data.
"""

from __future__ import annotations

import io
import os
import pickle
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

SHARDS = 8
AUGMENT = ("[{_target_: torchvision.transforms.RandomCrop, size: 32, padding: 4}, "
           "{_target_: torchvision.transforms.RandomHorizontalFlip}]")
MEAN, STD = "[0.4914,0.4822,0.4465]", "[0.2470,0.2435,0.2616]"


def images(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, n)
    pixels = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    return pixels, labels


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_tars(root: Path, pixels: np.ndarray, labels: np.ndarray, prefix: str = "train") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for s, part in enumerate(np.array_split(np.arange(len(labels)), SHARDS if prefix == "train" else 1)):
        with tarfile.open(root / f"{prefix}-{s:03d}.tar", "w") as tar:
            for k in part:
                for field, raw in (("png", png(pixels[k])), ("cls", str(int(labels[k])).encode())):
                    info = tarfile.TarInfo(f"{k:07d}.{field}")
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return root


def write_parquet(root: Path, pixels: np.ndarray, labels: np.ndarray) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    files = []
    for s, part in enumerate(np.array_split(np.arange(len(labels)), SHARDS)):
        path = root / f"train-{s:03d}.parquet"
        pq.write_table(pa.table({"id": pa.array(part, pa.int64()),
                                 "png": pa.array([png(pixels[k]) for k in part], pa.binary()),
                                 "label": pa.array(labels[part], pa.int64())}), path)
        files.append(str(path))
    return files


def write_cifar(root: Path, pixels: np.ndarray, labels: np.ndarray) -> Path:
    """The same images as CIFAR-10's python batches (data=cifar10 with data.verify=false)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    flat = pixels.transpose(0, 3, 1, 2).reshape(len(labels), -1)
    parts = np.array_split(np.arange(len(labels)), 5)
    for i, part in enumerate(parts, start=1):
        entry = {"data": flat[part], "labels": labels[part].tolist()}
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(entry, protocol=2))
    test = parts[0][:64]
    (folder / "test_batch").write_bytes(pickle.dumps({"data": flat[test], "labels": labels[test].tolist()},
                                                     protocol=2))
    return root


# ---------------------------------------------------------------------- readers
def _rate(batches, n: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    seen: list[int] = []
    for ids in batches:
        seen.extend(ids)
    return n / (time.perf_counter() - start), seen


def ddpexp_reader(root: Path, workers: int, n: int, cut: int | None = None):
    """The ids of one epoch through data=shards' reader (sampler skip: a resume)."""
    import torch
    from torch.utils.data import DataLoader

    from ddpexp.data.base import ResumableDistributedSampler
    from ddpexp.data.shards import Shards

    source = Shards(path=str(root), test="none", input_key="png", batch_size=64)
    train, _ = source.load()
    order = ResumableDistributedSampler(train, num_replicas=1, rank=0, seed=0)
    ids = [(int(train.index.shard[r]), int(train.index.spans[r][0])) for r in train.rows]  # (shard, offset)

    def epoch(skip: int = 0):
        order.set_epoch(0, skip=skip)
        loader = DataLoader(train, batch_size=64, sampler=order, num_workers=workers,
                            generator=torch.Generator().manual_seed(0))
        index = iter(order)
        for x, _ in loader:
            yield [ids[next(index)] for _ in range(len(x))]

    if cut is None:
        return _rate(epoch(), n)
    first = [i for batch in epoch() for i in batch][:cut]
    return first + [i for batch in epoch(skip=cut) for i in batch]


def webdataset_reader(root: Path, workers: int, n: int):
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [str(p) for p in sorted(root.glob("train-*.tar"))]
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.single_node_only,
                         workersplitter=wds.split_by_worker, empty_check=False)
          .shuffle(1000).decode("torchrgb").to_tuple("__key__", "png", "cls").batched(64))
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return _rate(([int(k) for k in keys] for keys, _, _ in loader), n)


def hf_reader(files: list[str], workers: int, n: int, cut: int | None = None):
    from torch.utils.data import DataLoader

    from ddpexp.data.hf import datasets_module

    datasets = datasets_module()
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    def decode(row):
        image = pil_to_tensor(Image.open(io.BytesIO(row["png"]))).float().div_(255)
        return {"id": row["id"], "x": image, "label": row["label"]}

    def stream():
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        return ds.shuffle(seed=0, buffer_size=1000).map(decode, remove_columns=["png"])

    if cut is None:
        loader = DataLoader(stream().with_format("torch"), batch_size=64, num_workers=workers)
        return _rate((batch["id"].tolist() for batch in loader), n)
    ds = stream()
    first = []
    for row in ds:
        first.append(int(row["id"]))
        if len(first) == cut:
            state = ds.state_dict()
            break
    again = stream()
    again.load_state_dict(state)
    return first + [int(row["id"]) for row in again]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def readers_table(quick: bool, repeats: int) -> str:
    n = 512 if quick else 4096
    pixels, labels = images(n)
    lines = [f"readers: one epoch of {n} PNG images (3x32x32) in {SHARDS} shards, decoded to "
             f"tensors, batch 64; medians of {repeats} round(s); load average "
             f"{os.getloadavg()[0]:.1f} at the start", "",
             "| reader | samples/s, 0 workers | samples/s, 2 workers | resumed after 40%: lost / twice |",
             "|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-readers-") as tmp:
        root = write_tars(Path(tmp) / "tars", pixels, labels)
        write_tars(root, pixels[:64], labels[:64], prefix="val")  # nothing held out of train
        cut = int(0.4 * n)
        rows = {"ddpexp data=shards": (lambda w: ddpexp_reader(root, w, n),
                                       lambda: ddpexp_reader(root, 0, n, cut=cut))}
        if _importable("webdataset"):
            rows["webdataset"] = (lambda w: webdataset_reader(root, w, n), None)
        if _importable("datasets"):
            files = write_parquet(Path(tmp) / "parquet", pixels, labels)
            rows["HF IterableDataset (Parquet)"] = (lambda w: hf_reader(files, w, n),
                                                     lambda: hf_reader(files, 0, n, cut=cut))
        ids = {"ddpexp data=shards": None}
        for name, (read, resume) in rows.items():
            rates = {0: [], 2: []}
            for _ in range(repeats):
                for workers in rates:
                    rate, seen = read(workers)
                    rates[workers].append(rate)
                    ids[name] = seen
                    print(f"readers {name:30s} workers {workers} samples/s {rate:7.0f}",
                          file=sys.stderr, flush=True)
            assert len(set(ids[name])) == len(ids[name]) == n, (name, len(ids[name]))
            if resume is None:
                outcome = "no state to resume from"
            else:
                got = resume()
                lost, twice = n - len(set(got)), len(got) - len(set(got))
                outcome = f"{lost} / {twice}"
            lines.append(f"| {name} | {statistics.median(rates[0]):.0f} | "
                         f"{statistics.median(rates[2]):.0f} | {outcome} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the loop
def loader_table(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    import bench

    n = 1280 if quick else 10240
    steps = 12 if quick else 120
    pixels, labels = images(n)
    common = ["model=convnet", "data.batch_size=64", "trainer.procs=1", "trainer.max_epochs=1",
              f"trainer.max_steps={steps}", "trainer.log_every_n_steps=4", "trainer.progress_bar=false",
              "~callbacks.checkpoint", "trainer.limit_val_batches=1"]
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-loader-") as tmp:
        work = Path(tmp)
        cifar = write_cifar(work / "cifar", pixels, labels)
        tars = write_tars(work / "tars", pixels, labels)
        variants = {
            "pre-loaded tensors": ["data=cifar10", f"data.root={cifar}", "data.verify=false",
                                   "data.train_transform=null"],
            "pre-loaded tensors, crop+flip, 2 workers": [
                "data=cifar10", f"data.root={cifar}", "data.verify=false", "data.num_workers=2"],
            "data=shards, crop+flip, 2 workers": [
                "data=shards", f"data.path={tars}", "data.input_key=png", "data.val=none", "data.test=none",
                "data.num_workers=2", f"data.mean={MEAN}", f"data.std={STD}",
                f"data.train_transform={AUGMENT}"],
        }
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(repeats):
            names = list(variants)
            for name in names[r % len(names):] + names[:r % len(names)]:
                out = work / f"run-{names.index(name)}-{r}"
                cmd = [sys.executable, "-m", "ddpexp", *common, *variants[name],
                       f"hydra.run.dir={out}"]
                bench.run_command(cmd, work, env, timeout)
                rate = bench.steady_rate(bench._scalars(out / "tb").get("train/samples_per_s", []), 4)
                assert rate is not None
                rates[name].append(rate)
                print(f"[{r + 1}/{repeats}] loader {name:42s} samples/s {rate:6.0f}  "
                      f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        cost = batch_cpu_ms(tars, cifar)
    base = rates["pre-loaded tensors"]
    lines = [f"loader: convnet, batch 64, one process, {steps} steps over {n} images, samples/s "
             f"after step 4; medians of {repeats} round(s), paired ratios; load average "
             f"{os.getloadavg()[0]:.1f} at the end", "",
             "| data | samples/s | step time / pre-loaded tensors |", "|---|---|---|"]
    for name, mine in rates.items():
        ratio = statistics.median(b / a for a, b in zip(mine, base, strict=True))
        lines.append(f"| {name} | {statistics.median(mine):.0f} | {ratio:.3f} |")
    ratio = statistics.median(b / a for a, b in zip(rates["data=shards, crop+flip, 2 workers"], base,
                                                    strict=True))
    step_ms = 64 / statistics.median(base) * 1000
    lines += ["", f"CPU time to make one batch of 64 in one process: crop+flip of pre-loaded "
              f"tensors {cost['tensors']:.1f} ms, PNG decode + crop+flip from the shards "
              f"{cost['shards']:.1f} ms; the step on pre-loaded tensors takes {step_ms:.1f} ms "
              f"on {os.cpu_count()} cores, which the loader workers share with it"]
    lines += ["", f"loader: augmented shards in 2 workers step at {ratio:.3f}x the pre-loaded "
              f"tensors' step time (target <= 1.05): {'met' if ratio <= 1.05 else 'MISSED'}"]
    return "\n".join(lines)


def batch_cpu_ms(tars: Path, cifar: Path) -> dict[str, float]:
    """Process CPU ms per batch of 64 made in this process, as a loader worker makes them:
    augmented pre-loaded tensors, and augmented samples decoded from the shards."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from ddpexp.data.shards import Shards
    from ddpexp.data.sources import CIFAR10

    aug = OmegaConf.to_container(OmegaConf.create({"t": OmegaConf.create(f"t: {AUGMENT}").t}))["t"]
    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    out = {}
    for name, source in (("tensors", CIFAR10(root=str(cifar), verify=False, mean=mean, std=std,
                                             train_transform=aug)),
                         ("shards", Shards(path=str(tars), input_key="png", mean=mean, std=std,
                                           train_transform=[instantiate(a) for a in aug]))):
        train = source.load()[0]
        start = time.process_time()
        for i in range(640):
            train[i]
        out[name] = (time.process_time() - start) / 10 * 1000
    return out


def data_bench(quick: bool, repeats: int, env: dict, timeout: float) -> str:
    return readers_table(quick, repeats) + "\n\n" + loader_table(quick, repeats, env, timeout)
