"""A peer of ``scripts/bench.py`` (``--peers``): the plain loop's training as Lightning users
write it.

A ``LightningModule`` around the same model class (``ddpexp.models``), the same data
(``plain_ddp.synthetic``), the same SGD settings and threads per worker, trained by
``Trainer(strategy="ddp", devices=--procs, max_steps=--steps)`` with Lightning's defaults
otherwise (its logger and end-of-run checkpoint included; the progress bar and the model
summary off, as bench.py turns ddpexp's progress bar off). Lightning's DDP strategy starts the
other ranks by re-running this script. Takes ``scripts/plain_ddp.py``'s arguments (DataParallel,
which Lightning 2 no longer has, excepted) and writes the same JSON from rank 0.

    python scripts/lightning_ddp.py --model mlp --procs 2 --batch-size 32 --steps 200 --out r.json
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from plain_ddp import parse_args, synthetic  # this script's folder is on sys.path
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning as L
except ImportError:  # the older package name
    import pytorch_lightning as L


class Classifier(L.LightningModule):
    """Cross-entropy on the model's logits; SGD with the plain loop's settings."""

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float, compile: bool):
        super().__init__()
        self.model = model
        self.forward_fn = torch.compile(model) if compile else model
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.forward_fn(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Timer(L.Callback):
    """Rank 0 times what plain_ddp.py times: the end of step 1, and steps warmup..last."""

    def __init__(self, args) -> None:
        self.args = args
        self.first_step_at = None
        self.t_warm = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # optimizer steps done
        if step in (1, self.args.warmup, self.args.steps) and self.args.device == "cuda":
            torch.cuda.synchronize()
        if step == 1 and self.first_step_at is None:
            self.first_step_at = time.time()
        if step == self.args.warmup and self.t_warm is None:
            self.t_warm = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0 or not self.args.out:
            return
        measured = self.args.steps - self.args.warmup
        rate = None
        if self.t_warm is not None and measured > 0:
            elapsed = time.perf_counter() - self.t_warm
            rate = measured * self.args.batch_size * trainer.world_size / elapsed
        with open(self.args.out, "w") as f:
            json.dump({"first_step_at": self.first_step_at, "samples_per_s": rate}, f)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.strategy != "ddp":
        raise SystemExit("lightning_ddp.py: Lightning 2 has no DataParallel; use --strategy ddp")
    from ddpexp.models import MLP, ConvNet

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // args.procs))
    x, y = synthetic(args.num_samples, args.shape, args.num_classes, seed=args.seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                        pin_memory=args.device == "cuda")
    L.seed_everything(args.seed, verbose=False)
    cls = MLP if args.model == "mlp" else ConvNet
    module = Classifier(cls(input_shape=args.shape, num_classes=args.num_classes),
                        args.lr, args.momentum, args.compile)
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.procs,
        strategy="ddp",
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
        max_steps=args.steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(os.path.abspath(args.out)) if args.out else None,
        callbacks=[Timer(args)],
    )
    trainer.fit(module, loader)


if __name__ == "__main__":
    main()
