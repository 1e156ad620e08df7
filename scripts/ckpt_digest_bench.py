"""What a checkpoint's SHA-256 costs: saving and reading a ~150M-parameter state_dict with
and without the digest that :mod:`ddpexp.checkpoint.io` writes beside it.

The model is a stack of ``nn.Linear(4096, 4096)`` layers (16.8M parameters each; 9 of them
are 151M, 604 MB in fp32). Each round runs every variant once, in turn (every other round
in reverse order), so that a machine busy with other work slows all of them alike; the
figures are medians over the rounds. Each timed save follows a save (see main).

    save, no digest    torch.save to a temporary file, fsync, rename, fsync dir (the
                       save as it was before digests)
    save + digest      ddpexp.checkpoint.io.save_atomic: the same, then the file hashed and
                       its digest written atomically beside it
    digest alone       hashing the saved file (sha256, and blake2b for comparison)
    verify             ddpexp.checkpoint.io.verify: the digest checked, the archive
                       mapped (no tensor read); without digest: the archive mapped only
    load               ddpexp.checkpoint.io.load, with and without a digest beside the file

Usage::

    python scripts/ckpt_digest_bench.py                 # 9 layers, 7 rounds, under ./outputs
    python scripts/ckpt_digest_bench.py --layers 2 --rounds 1 --dir /tmp   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io as ckpt_io


def state_dict(layers: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(layers)))
    return {"model": model.state_dict(), "step": 1}


def save_plain(obj: dict, path: Path) -> None:
    """The atomic save without a digest: temporary file, fsync, rename, fsync dir."""
    tmp = path.with_name(path.name + ".tmp-bench")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(path: Path, name: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, name).hexdigest()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=Path("outputs"),
                        help="where the checkpoints are written (the disk runs write to)")
    args = parser.parse_args()
    obj = state_dict(args.layers)
    params = sum(t.numel() for t in obj["model"].values())
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-digest-bench-", dir=args.dir))
    plain, digested = work / "plain.pt", work / "digested.pt"
    saves: dict[str, Callable[[], object]] = {
        "save, no digest": lambda: save_plain(obj, plain),
        "save + digest": lambda: ckpt_files.save_atomic(obj, digested),
    }
    reads: dict[str, Callable[[], object]] = {
        "sha256 of the file": lambda: hash_file(digested, "sha256"),
        "blake2b of the file": lambda: hash_file(digested, "blake2b"),
        "verify, no digest": lambda: ckpt_io.verify(plain),
        "verify + digest": lambda: ckpt_io.verify(digested),
        "load, no digest": lambda: ckpt_io.load(plain),
        "load + digest": lambda: ckpt_io.load(digested),
    }
    times: dict[str, list[float]] = {name: [] for name in (*saves, *reads)}
    try:
        for round_ in range(args.rounds):
            # A save right after a load of 600 MB takes up to 3x as long, digest or not
            # (the memory the load freed is faulted in again): an untimed save first, so
            # that each timed one follows a save. Odd rounds run each group in reverse.
            save_plain(obj, plain)
            for group in (saves, reads):
                order = list(group) if round_ % 2 == 0 else list(reversed(group))
                for name in order:
                    times[name].append(timed(group[name]))
        size = digested.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.layers} x Linear(4096, 4096): {params / 1e6:.1f}M parameters, "
          f"{size / 1e6:.0f} MB; median of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} CPUs, {args.dir.resolve()}")
    print(f"{'':22} {'median s':>9} {'min s':>7} {'GB/s':>6}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:22} {median:9.3f} {min(values):7.3f} {size / median / 1e9:6.2f}")


if __name__ == "__main__":
    main()
