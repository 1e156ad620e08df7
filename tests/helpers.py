"""Helpers shared by the tests: compose the real config with Hydra's compose API and build a
one-process trainer from it (seams and arithmetic tested without a subprocess), write
datasets in their real file formats, and compare checkpoints tensor by tensor."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ddpexp.config.compose import compose_single_process
from ddpexp.config.schema import register_configs

register_configs()


def compose_config(*overrides: str, config_dir: Optional[Path] = None) -> dict:
    """The resolved config (plain Python, as workers receive it) for ``overrides``, with the
    task's monitor filled in as a run's parent does. ``config_dir`` is a user's own config dir
    (``--config-dir``)."""
    return compose_single_process(list(overrides), config_dir)


def build_trainer(run_dir: Path, overrides: Sequence[str] = (), config_dir: Optional[Path] = None):
    """A one-process :class:`ddpexp.training.trainer.Trainer` built from the composed config."""
    from ddpexp.strategies.dist import DistContext
    from ddpexp.training.trainer import Trainer

    plain = compose_config("trainer.progress_bar=false", *overrides, config_dir=config_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Trainer.from_config(plain, DistContext(), Path(run_dir))


def run_cli_here(args: Sequence[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    """``python -m ddpexp ARGS`` in this process (Hydra's ``main`` included): its exit status
    and everything it printed. Milliseconds instead of a subprocess's seconds; for runs of
    one worker (several need processes of their own anyway)."""
    import sys

    import pytest

    import ddpexp.launch.proc
    from ddpexp.__main__ import cli

    def exit_now(code: int = 0) -> None:  # the real one ends the process: end the call
        raise SystemExit(code)

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["ddpexp", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(ddpexp.launch.proc, "exit_now", exit_now)
    capsys.readouterr()  # what the test printed before is not the CLI's
    with pytest.raises(SystemExit) as exited:
        cli()
    code = exited.value.code
    out = capsys.readouterr()
    status = code if isinstance(code, int) else 1  # sys.exit("message") exits 1
    return status, out.out + out.err + (code if isinstance(code, str) else "")


# ---------------------------------------------------------------- data files in real formats
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


# ---------------------------------------------------------------- checkpoints
def assert_same_tensors(a, b, where: str) -> None:
    """``a`` and ``b`` have the same structure and every tensor in them is ``torch.equal``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
