"""The baseline of ``scripts/bench.py``: a PyTorch DDP loop as users write it, nothing else.

``mp.spawn`` the workers, ``init_process_group`` on a free loopback port, a DistributedSampler
+ DataLoader, DistributedDataParallel, SGD, the loop, ``destroy_process_group``, and the
normal interpreter exit a user's script pays. It trains on the same data (ddpexp's
``data=synthetic`` generation, re-written here), the same model classes (``ddpexp.models``, so
both runs do identical arithmetic), the same optimizer settings (ddpexp's ``optimizer=sgd``
defaults) and the same threads per worker as ddpexp (the cores split evenly between the
workers).

On a GPU (``--device cuda``): NCCL DDP, one process per GPU, or ``--strategy dp`` (one process,
``nn.DataParallel``); ``--precision bf16`` autocasts the forward pass and ``--compile`` wraps the
model in ``torch.compile``, as ddpexp's ``trainer.precision`` and ``trainer.compile`` do.

Rank 0 writes a JSON file with the wall-clock time of the end of the first optimizer step and
the steady-state throughput: global samples over the rank-0 wall time from the end of step
``--warmup`` to the end of the last step (the same window bench.py reads from ddpexp's
``train/samples_per_s`` TensorBoard scalars).

    python scripts/plain_ddp.py --model mlp --procs 2 --batch-size 32 --steps 200 --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--procs", type=int, default=2, help="processes (one per GPU on cuda)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the throughput")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--strategy", choices=("ddp", "dp", "fsdp"), default="ddp")
    p.add_argument("--precision", choices=("32", "bf16"), default="32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--out", default=None, help="JSON file rank 0 writes its timings to")
    return p.parse_args(argv)


def free_port() -> int:
    """A port the OS picks (never a fixed number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic(n: int, shape, num_classes: int, noise: float = 1.0, seed: int = 0):
    """ddpexp's ``data=synthetic`` training split: class prototypes plus Gaussian noise,
    built in place in the noise tensor (one copy of the data set in memory)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn((num_classes, *shape), generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = torch.randn((n, *shape), generator=g).mul_(noise)
    for start in range(0, n, 4096):
        x[start:start + 4096] += prototypes[y[start:start + 4096]]
    return x, y


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddpexp.models import MLP, ConvNet

    cuda = args.device == "cuda"
    ddp = args.strategy in ("ddp", "fsdp")  # one process per rank, a process group
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // args.procs))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.procs)
    try:
        x, y = synthetic(args.num_samples, args.shape, args.num_classes, seed=args.seed)
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed) if ddp else None
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            shuffle=not ddp, pin_memory=cuda)
        torch.manual_seed(args.seed)
        cls = MLP if args.model == "mlp" else ConvNet
        model = cls(input_shape=args.shape, num_classes=args.num_classes).to(device)
        if args.strategy == "fsdp":
            # FSDP2 as its tutorial writes it: the whole model one unit, bf16 parameters and
            # fp32 reduction where bf16 is asked for, BatchNorm kept in fp32 (its kernels
            # refuse bf16 weights beside fp32 running statistics).
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if args.precision == "bf16" else MixedPrecisionPolicy()
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    fully_shard(m)
            fully_shard(model, mp_policy=mp)
        elif ddp:
            model = DDP(model, device_ids=[rank] if cuda else None)
        elif torch.cuda.device_count() > 1:  # as ddpexp: DataParallel only over several GPUs
            model = nn.DataParallel(model)
        forward = torch.compile(model) if args.compile else model
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16"
                    else contextlib.nullcontext())
        model.train()
        step, epoch, first_step_at, t_warm = 0, 0, None, None
        while step < args.steps:
            if sampler is not None:
                sampler.set_epoch(epoch)
            for xb, yb in loader:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                with autocast:
                    out = forward(xb)
                loss = F.cross_entropy(out.float(), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if step in (1, args.warmup, args.steps) and cuda:
                    torch.cuda.synchronize()  # the timestamps below are for finished steps
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
            world = args.procs if ddp else 1
            rate = (measured * args.batch_size * world / (t_end - t_warm)
                    if t_warm is not None and measured > 0 else None)
            with open(args.out, "w") as f:
                json.dump({"first_step_at": first_step_at, "samples_per_s": rate,
                           "final_loss": loss.detach().item()}, f)
    finally:
        if ddp:
            dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    if args.strategy == "dp":  # one process drives every GPU
        args.procs = 1
        worker(0, args)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as ddpexp does on one node
    mp.spawn(worker, args=(args,), nprocs=args.procs)


if __name__ == "__main__":
    main()
