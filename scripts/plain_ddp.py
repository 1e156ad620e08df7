"""The baseline of ``scripts/bench.py``: a hand-written PyTorch DDP loop, nothing else.

DistributedSampler + DataLoader + DistributedDataParallel + SGD on CPU (gloo), started with
``torch.multiprocessing`` (spawn, as torch elastic starts ddpexp's workers), on a free loopback
port. It trains on the same data (ddpexp's ``data=synthetic`` generation, re-written here),
the same model classes (``ddpexp.models``, so both runs do identical arithmetic), the same
optimizer settings (ddpexp's ``optimizer=sgd`` defaults) and the same threads per worker as
ddpexp (``ddpexp.worker.set_threads``: the cores split evenly between the workers).

Rank 0 writes a JSON file with the wall-clock time of the end of the first optimizer step and
the steady-state throughput: global samples over the rank-0 wall time from the end of step
``--warmup`` to the end of the last step (the same window bench.py reads from ddpexp's
``train/samples_per_s`` TensorBoard scalars).

    python scripts/plain_ddp.py --model mlp --procs 2 --batch-size 32 --steps 200 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    p.add_argument("--shape", type=int, nargs=3, default=[3, 32, 32])
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the throughput")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file rank 0 writes its timings to")
    return p.parse_args(argv)


def free_port() -> int:
    """A port the OS picks (never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic(n: int, shape, num_classes: int, noise: float = 1.0, seed: int = 0):
    """ddpexp's ``data=synthetic`` training split: class prototypes plus Gaussian noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn((num_classes, *shape), generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = prototypes[y] + noise * torch.randn((n, *shape), generator=g)
    return x, y


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddpexp.models import MLP, ConvNet

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // args.procs))
    dist.init_process_group("gloo", rank=rank, world_size=args.procs)
    try:
        x, y = synthetic(args.num_samples, args.shape, args.num_classes, seed=args.seed)
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        torch.manual_seed(args.seed)
        cls = MLP if args.model == "mlp" else ConvNet
        model = DDP(cls(input_shape=args.shape, num_classes=args.num_classes))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        model.train()
        step, epoch, first_step_at, t_warm = 0, 0, None, None
        while step < args.steps:
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if step == 1:
                    first_step_at = time.time()
                if step == args.warmup:
                    t_warm = time.perf_counter()
                if step >= args.steps:
                    break
            epoch += 1
        t_end = time.perf_counter()
        if rank == 0 and args.out:
            measured = args.steps - args.warmup
            rate = (measured * args.batch_size * args.procs / (t_end - t_warm)
                    if t_warm is not None and measured > 0 else None)
            with open(args.out, "w") as f:
                json.dump({"first_step_at": first_step_at, "samples_per_s": rate,
                           "final_loss": loss.detach().item()}, f)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as ddpexp does on one node
    mp.start_processes(worker, args=(args,), nprocs=args.procs, start_method="spawn")


if __name__ == "__main__":
    main()
