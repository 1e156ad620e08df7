"""What ddpexp's training step costs over a plain loop's, in one process, free of machine drift.

Across separate runs on a small shared machine the same command's throughput moves by 10-20%
(docs/benchmarks.md), which hides a difference of a few percent per step. Here one process
holds both: ddpexp's trainer (built from the composed config, as a worker builds it, and run
through its own ``_train_epoch``: loader, task step, metric sums, optimizer step, log steps)
and the plain loop of ``scripts/plain_ddp.py`` (DataLoader with shuffling, the same model
class, ``cross_entropy``, SGD with the same settings). Chunks of K steps alternate between
the two, so whatever the machine does at a given moment lands on both: the per-chunk time
ratio is the framework's cost per step, its log step included (one per chunk).

One process, one thread, no DDP: the gradient all-reduce is the same call in both and is
left out. ``scripts/bench.py`` measures the multi-process runs.

    python scripts/step_overhead.py                            # MLP, batch 32, 100 chunks
    python scripts/step_overhead.py --model convnet --batch-size 64 --chunks 20
    python scripts/step_overhead.py --dataloader               # ddpexp on a DataLoader too
    python scripts/step_overhead.py trainer.channels_last=true  # any ddpexp override
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunks", type=int, default=100, help="chunks of each (the first 2 are warm-up)")
    p.add_argument("--steps-per-chunk", type=int, default=20, help="= ddpexp's log_every_n_steps")
    p.add_argument("--dataloader", action="store_true",
                   help="ddpexp on data.fast_path=false (the plain loop's DataLoader pipeline)")
    p.add_argument("overrides", nargs="*", help="more ddpexp overrides, e.g. trainer.channels_last=true")
    return p.parse_args(argv)


class Interleaved:
    """Wraps ddpexp's training loader: before every K-th batch it closes the timing of the
    K ddpexp steps just done and runs K plain steps, timed on their own."""

    def __init__(self, inner, k: int, plain_chunk, ddpexp_times: list[float]):
        self.inner, self.k, self.plain_chunk, self.times = inner, k, plain_chunk, ddpexp_times

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        started = None
        for i, batch in enumerate(self.inner):
            if i % self.k == 0:
                if started is not None:
                    self.times.append(time.perf_counter() - started)
                    self.plain_chunk()
                started = time.perf_counter()
            yield batch


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from ddpexp.config.compose import compose_single_process
    from ddpexp.models import MLP, ConvNet
    from ddpexp.runtime.dist import DistContext
    from ddpexp.training.trainer import Trainer

    k = args.steps_per_chunk
    steps = k * (args.chunks + 1)
    n = steps * args.batch_size
    config = compose_single_process([
        "data=synthetic", "data.shape=[3,32,32]", f"data.num_samples={n}",
        f"data.batch_size={args.batch_size}", f"model={args.model}", f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={k}", "trainer.progress_bar=false",
        *(["++data.fast_path=false"] if args.dataloader else []), *args.overrides,
    ])
    with tempfile.TemporaryDirectory(prefix="ddpexp-step-") as run_dir:
        trainer = Trainer.from_config(config, DistContext(), Path(run_dir))
        torch.set_num_threads(1)

        # The plain loop, as scripts/plain_ddp.py writes it, on a copy of the same samples.
        data = trainer.train_loader.dataset
        x, y = data.x.clone(), data.y.clone()
        torch.manual_seed(0)
        model = (MLP if args.model == "mlp" else ConvNet)(input_shape=(3, 32, 32), num_classes=10)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batches = iter(DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True))
        model.train()
        plain_times: list[float] = []

        def plain_chunk() -> None:
            started = time.perf_counter()
            for _ in range(k):
                xb, yb = next(batches)
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            plain_times.append(time.perf_counter() - started)

        ddpexp_times: list[float] = []
        trainer.train_loader = Interleaved(trainer.train_loader, k, plain_chunk, ddpexp_times)
        trainer._open_loggers()  # its TensorBoard writer: log steps write to it
        trainer.callbacks.fire("on_fit_start", trainer)  # the default callbacks, as fit() has them
        trainer.model.train()
        try:
            trainer._train_epoch()
        finally:
            trainer.loggers.finalize("completed")

    mine, theirs = ddpexp_times[2:], plain_times[2:]  # the first chunks warm both up
    # Interleaved times a ddpexp chunk only when it runs a plain one after it: equal lengths.
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    loader = "DataLoader" if args.dataloader else "default loader"
    print(f"{args.model}, batch {args.batch_size}, ddpexp ({loader}) vs plain loop, "
          f"{len(ratios)} alternating chunks of {k} steps, one process, one thread")
    print(f"ms per step: plain {1e3 * statistics.median(theirs) / k:.3f}, "
          f"ddpexp {1e3 * statistics.median(mine) / k:.3f}")
    print(f"ddpexp time / plain time per chunk: median {statistics.median(ratios):.3f}, "
          f"quartiles {statistics.quantiles(ratios, n=4)[0]:.3f} to "
          f"{statistics.quantiles(ratios, n=4)[2]:.3f}; totals {sum(mine) / sum(theirs):.3f}")
    print(f"speed ratio (plain time / ddpexp time, totals): {sum(theirs) / sum(mine):.3f}")


if __name__ == "__main__":
    main()
