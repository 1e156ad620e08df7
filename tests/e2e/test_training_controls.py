"""The training controls end to end through the CLI: gradient accumulation (single process and
DDP), mixed precision, early stopping, the lr schedules, gradient clipping, channels_last,
torch.compile and sync_batchnorm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import (
    one_worker,
    only_run_dir,
    read_metrics,
    read_scalars,
    run_cli,
    run_cli_in_process,
)

# Tiny learnable data and an MLP without BatchNorm or dropout, so a step's gradient is a plain
# function of which samples it saw.
SYN = ["data=synthetic", "data.num_samples=16", "data.val_samples=4", "data.shape=[4]",
       "data.num_classes=3", "model=mlp", "model.hidden=[8]"]
PLAIN_SGD = ["optimizer.momentum=0.0", "optimizer.weight_decay=0.0"]


def run(cwd: Path, args: list[str], **kw) -> Path:
    """Run the CLI in a fresh sub-dir of ``cwd`` and return the run dir: in this process
    where the run is one worker (torch.compile aside, whose caches would outlive the test),
    else as its own process."""
    cwd.mkdir(parents=True, exist_ok=True)
    if one_worker(args) and "trainer.compile=true" not in args:
        run_cli_in_process(args, cwd, env=kw.get("env"))
    else:
        run_cli(args, cwd, **kw)
    return only_run_dir(cwd)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def initial_mlp() -> dict[str, torch.Tensor]:
    """The weights a run with seed 0 starts from (the trainer seeds, then builds the model)."""
    from ddpexp.models import MLP
    from ddpexp.runtime.dist import seed_everything

    seed_everything(0)
    return MLP(input_shape=[4], num_classes=3, hidden=[8], dropout=0.0).state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------- accumulation
def one_step(cwd: Path, batch: int, accumulate: int, extra: list[str] = (), steps: int = 1) -> dict:
    run_dir = run(cwd, [*SYN, *PLAIN_SGD, "optimizer.lr=0.5", f"data.batch_size={batch}",
                        f"trainer.accumulate={accumulate}", f"trainer.max_steps={steps}", *extra])
    assert read_metrics(run_dir)["steps"] == steps
    return weights(run_dir)


def test_accumulate_2_equals_double_batch(workdir):
    """One optimizer step of 2 micro-batches of 4 lands on the weights of one batch of 8 (the
    sampler's order does not depend on the batch size, so both see the same 8 samples)."""
    accumulated = one_step(workdir / "acc", batch=4, accumulate=2)
    whole = one_step(workdir / "whole", batch=8, accumulate=1)
    assert_same_weights(accumulated, whole)
    moved = max((accumulated[k] - v).abs().max().item() for k, v in initial_mlp().items())
    assert moved > 1e-3  # the step did change the weights, so the comparison means something


def test_accumulate_uneven_last_group_is_a_mean(workdir):
    """10 samples, batch 4, accumulate 3: the one step sees 4+4+2 samples; its gradient must be
    their mean, i.e. equal to one batch of 10."""
    extra = ["data.num_samples=10"]
    accumulated = one_step(workdir / "acc", batch=4, accumulate=3, extra=extra)
    whole = one_step(workdir / "whole", batch=10, accumulate=1, extra=extra)
    assert_same_weights(accumulated, whole)


@pytest.mark.slow
def test_accumulate_under_ddp(workdir):
    """2 gloo ranks: micro-batches of 2 x accumulate 2 (no_sync on the first) equal batches of
    4, and both equal one process with a batch of 8 (rank r sees samples r, r+2, ... of the
    same permutation, so the two ranks' 4 samples are the single process's 8), for 3 steps
    over 2 epochs: the gradients, views into DDP's buckets that are set to None after each
    step, start from zero at every step."""
    ddp = ["trainer.procs=2"]
    accumulated = one_step(workdir / "acc", batch=2, accumulate=2, extra=ddp, steps=3)
    whole = one_step(workdir / "whole", batch=4, accumulate=1, extra=ddp, steps=3)
    single = one_step(workdir / "single", batch=8, accumulate=1, steps=3)
    assert_same_weights(accumulated, whole)
    assert_same_weights(whole, single)


# ---------------------------------------------------------------- precision
def test_bf16_and_channels_last_on_cpu(workdir):
    """bf16 autocast on the CPU, with a BatchNorm ConvNet fed channels_last batches."""
    run_dir = run(workdir, ["data=synthetic", "data.num_samples=16", "data.val_samples=4",
                            "data.shape=[3,5,6]", "data.num_classes=3", "data.batch_size=4",
                            "trainer.precision=bf16", "trainer.channels_last=true",
                            "trainer.max_epochs=1", "trainer.log_every_n_steps=1"])
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed" and metrics["steps"] == 4
    losses = [v for _, v in read_scalars(run_dir / "tb")["train/loss"]]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert math.isfinite(metrics["final"]["val/loss"])
    # autocast computes in bf16 but the weights stay float32
    assert all(t.dtype == torch.float32 for t in weights(run_dir).values() if t.is_floating_point())


def test_fp16_on_cpu_is_refused_clearly(workdir):
    res = run_cli_in_process(["trainer.precision=16"], workdir, expect_ok=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "needs a GPU" in res.stderr and "trainer.precision=bf16" in res.stderr
    assert not (workdir / "outputs").exists() or not list((workdir / "outputs").glob("**/metrics.json"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_with_grad_scaler_on_gpu(workdir):
    run_dir = run(workdir, [*SYN, "trainer.gpus=1", "trainer.precision=16", "trainer.max_steps=2",
                            "data.batch_size=4"])
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["scaler"] is not None


# ---------------------------------------------------------------- early stopping
def test_early_stopping_stops(workdir):
    """With lr 0 the validation loss never improves: patience 2 stops after epoch 3 of 10."""
    run_dir = run(workdir, [*SYN, "optimizer.lr=0.0", "data.num_samples=8", "data.batch_size=4",
                            "trainer.max_epochs=10", "trainer.early_stop_patience=2",
                            "trainer.monitor=val/loss", "trainer.monitor_mode=min"])
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "early_stopped"
    assert metrics["epochs"] == 3 and len(metrics["history"]) == 3
    assert metrics["best"]["epoch"] == 0


def cosine_lr(s, *, base, total, warmup, min_lr):
    if s < warmup:
        return base * (s + 1) / warmup
    p = min(1.0, (s - warmup) / max(1, total - warmup))
    return min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * p))


def step_lr(s, *, base, warmup, per_epoch, step_size, gamma):
    if s < warmup:
        return base * (s + 1) / warmup
    return base * gamma ** ((s // per_epoch) // step_size)


def onecycle_lr(s, *, total, max_lr, pct, div, final_div):
    """OneCycleLR's documented cosine form: up from max_lr/div over pct*T-1 steps, then down
    to max_lr/div/final_div at step T-1."""
    start, end = max_lr / div, max_lr / div / final_div
    up = pct * total - 1

    def anneal(a, b, p):
        return b + (a - b) / 2 * (1 + math.cos(math.pi * p))

    if s <= up:
        return anneal(start, max_lr, s / up)
    return anneal(max_lr, end, (s - up) / (total - 1 - up))


# 16 samples, batch 4: 4 optimizer steps per epoch, 3 epochs = 12 steps.
SCHEDULES = {
    "cosine": (["scheduler.warmup_steps=3", "scheduler.min_lr=0.01"],
               lambda s: cosine_lr(s, base=0.2, total=12, warmup=3, min_lr=0.01)),
    "step": (["scheduler.warmup_steps=2", "scheduler.step_size=1", "scheduler.gamma=0.5"],
             lambda s: step_lr(s, base=0.2, warmup=2, per_epoch=4, step_size=1, gamma=0.5)),
    "onecycle": (["scheduler.pct_start=0.25"],
                 lambda s: onecycle_lr(s, total=12, max_lr=0.2, pct=0.25, div=25.0, final_div=1e4)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_scheduler_lr_curve_matches_formula(workdir, name):
    """train/lr at TensorBoard step n is the lr optimizer step n (1-based) used."""
    args, formula = SCHEDULES[name]
    run_dir = run(workdir, [*SYN, "optimizer.lr=0.2", "data.batch_size=4", "trainer.max_epochs=3",
                            "trainer.log_every_n_steps=1", f"scheduler={name}", *args])
    curve = read_scalars(run_dir / "tb")["train/lr"]
    assert [n for n, _ in curve] == list(range(1, 13))
    for n, lr in curve:
        assert lr == pytest.approx(formula(n - 1), rel=1e-5, abs=1e-9), (n, curve)


# ---------------------------------------------------------------- gradient clipping
def test_grad_clip_bounds_the_update(workdir):
    """``train/grad_norm`` is the total norm before clipping (clip_grad_norm_'s return value);
    with plain SGD at lr 1 the step actually taken has the clipped norm."""
    clip = 0.01
    run_dir = run(workdir, [*SYN, *PLAIN_SGD, "optimizer.lr=1.0", "data.batch_size=8",
                            f"trainer.grad_clip={clip}", "trainer.max_steps=1",
                            "trainer.log_every_n_steps=1"])
    logged = read_scalars(run_dir / "tb")["train/grad_norm"]
    assert len(logged) == 1 and logged[0][1] > 10 * clip  # clipping really happened
    after, before = weights(run_dir), initial_mlp()
    update = torch.cat([(after[k] - before[k]).flatten() for k in before]).norm().item()
    assert update == pytest.approx(clip, rel=1e-3)


# ---------------------------------------------------------------- compile
@pytest.mark.slow
def test_compile_runs_on_cpu(workdir):
    """torch.compile (inductor, which needs a C++ compiler on the CPU) on a tiny MLP."""
    run_dir = run(workdir, [*SYN, "data.batch_size=8", "trainer.compile=true",
                            "trainer.max_steps=2"], timeout=240)
    assert read_metrics(run_dir)["steps"] == 2


# ---------------------------------------------------------------- sync_batchnorm
def test_sync_batchnorm_on_cpu_ddp_is_refused(workdir):
    res = run_cli(["trainer.procs=2", "trainer.sync_batchnorm=true"], workdir, expect_ok=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "trainer.sync_batchnorm=true needs GPUs" in res.stderr


def test_sync_batchnorm_one_process_is_ignored_with_a_warning(workdir):
    res = run_cli_in_process(["data=synthetic", "data.num_samples=8", "data.val_samples=4",
                              "data.shape=[1,4,4]", "data.num_classes=3", "data.batch_size=4",
                              "trainer.sync_batchnorm=true", "trainer.strategy=ddp",
                              "trainer.max_steps=1"], workdir)
    assert "trainer.sync_batchnorm ignored" in res.output
    assert read_metrics(only_run_dir(workdir))["status"] == "completed"
