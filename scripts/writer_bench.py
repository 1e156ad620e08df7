"""What a checkpoint write costs the CPU, and how much of it a background write takes from
the loop beside it.

    write, torch.save     ddpexp.checkpoint.io.save_atomic with torch.save's archive (a CRC-32
                          of every record): wall and CPU seconds of the calling thread's process
    write, no CRC         save_atomic as it writes (ddpexp.checkpoint.io.write_archive)
    loop beside a write   a loop of matmuls on every intra-op thread, timed alone and with a
                          save_atomic running in a background thread, the writer at the loop's
                          priority and at the writer's (ddpexp.checkpoint.background.lower_priority);
                          the slowdown is the loop's time beside the write minus its time alone

The state is ``--mib`` MiB of fp32 tensors of 1024x1024. Each round runs every variant once
(every other round in reverse order); the figures are medians over the rounds.

Usage::

    python scripts/writer_bench.py                       # 1600 MiB, 3 rounds, under /tmp
    python scripts/writer_bench.py --mib 200 --rounds 1  # a quick look
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ddpexp.checkpoint import background
from ddpexp.checkpoint import files as ckpt_files


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write(state: dict, path: Path, crc: bool) -> tuple[float, float]:
    """One save_atomic of ``state``; ``crc``: through torch.save. Wall and CPU seconds."""
    own = ckpt_files.write_archive
    if crc:
        ckpt_files.write_archive = lambda obj, f: torch.save(obj, f)
    try:
        start, cpu = time.perf_counter(), cpu_s()
        ckpt_files.save_atomic(state, path)
        return time.perf_counter() - start, cpu_s() - cpu
    finally:
        ckpt_files.write_archive = own


def loop(steps: int) -> float:
    a, out = torch.randn(1024, 1024), torch.empty(1024, 1024)
    start = time.perf_counter()
    for _ in range(steps):
        torch.mm(a, a, out=out)
    return time.perf_counter() - start


def beside(state: dict, path: Path, steps: int, lowered: bool) -> float:
    """The loop's time with a background write of ``state`` running beside it."""

    def writer() -> None:
        if lowered:
            background.lower_priority()
        ckpt_files.save_atomic(state, path)

    thread = threading.Thread(target=writer)
    thread.start()
    took = loop(steps)
    thread.join()
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1600, help="the state's size (MiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=600, help="matmuls of the loop")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = p.parse_args()
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(args.mib // 4)}
    root = Path(tempfile.mkdtemp(prefix="writer-bench-", dir=args.dir))
    path = root / "last.pt"
    figures: dict[str, list[float]] = {}
    variants: list[tuple[str, Callable[[], None]]] = [
        ("write, torch.save", lambda: record("write, torch.save", *write(state, path, True))),
        ("write, no CRC", lambda: record("write, no CRC", *write(state, path, False))),
        ("loop alone", lambda: figures.setdefault("loop alone s", []).append(loop(args.steps))),
        ("beside, loop's priority", lambda: figures.setdefault("loop beside a write, loop's priority s", [])
         .append(beside(state, path, args.steps, False))),
        ("beside, writer's priority", lambda: figures.setdefault("loop beside a write, writer's priority s", [])
         .append(beside(state, path, args.steps, True))),
    ]

    def record(name: str, wall: float, cpu: float) -> None:
        figures.setdefault(f"{name}: wall s", []).append(wall)
        figures.setdefault(f"{name}: CPU s", []).append(cpu)

    try:
        write(state, path, False)  # the page cache and the file's blocks, for every variant alike
        for r in range(args.rounds):
            for _, run in variants if r % 2 == 0 else variants[::-1]:
                run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib} MiB, {args.rounds} round(s), {torch.get_num_threads()} intra-op threads; medians")
    print("| figure | median | rounds |")
    print("|---|---|---|")
    for name, values in figures.items():
        print(f"| {name} | {statistics.median(values):.2f} | {' / '.join(f'{v:.2f}' for v in values)} |")
    alone = statistics.median(figures["loop alone s"])
    for who in ("loop's", "writer's"):
        slower = statistics.median(figures[f"loop beside a write, {who} priority s"]) - alone
        print(f"loop slowed by a background write at the {who} priority: {slower:.2f} s")


if __name__ == "__main__":
    main()
