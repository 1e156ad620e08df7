"""GPU paths: NCCL DDP, DataParallel, mixed precision and torch.compile. They run where CUDA
exists and are skipped elsewhere (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import only_run_dir, read_metrics, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SMALL = ["data=synthetic", "data.shape=[3,32,32]", "data.num_samples=2048", "trainer.max_epochs=2"]


def ngpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("precision", ["32", "bf16", "16"])
def test_nccl_ddp_on_every_gpu(workdir, precision):
    n = ngpus()
    res = run_cli([*SMALL, f"trainer.gpus={n}", "trainer.strategy=ddp",
                   f"trainer.precision={precision}"], workdir)
    assert f"{n} worker(s): strategy=ddp, {n} GPU(s) per node" in res.output
    m = read_metrics(only_run_dir(workdir))
    assert m["status"] == "completed" and m["world_size"] == n
    assert m["best"]["val/acc"] > 0.5


def test_dataparallel_one_process(workdir):
    n = ngpus()
    res = run_cli([*SMALL, f"trainer.gpus={n}", "trainer.strategy=dp"], workdir)
    assert "1 worker(s): strategy=dp" in res.output
    assert read_metrics(only_run_dir(workdir))["world_size"] == 1


def test_compile_and_channels_last_on_gpu(workdir):
    run_cli([*SMALL, "trainer.gpus=1", "trainer.compile=true", "trainer.channels_last=true",
             "trainer.precision=bf16"], workdir, timeout=600)
    assert read_metrics(only_run_dir(workdir))["status"] == "completed"


def test_checkpoint_from_gpu_loads_on_cpu(workdir):
    run_cli([*SMALL, "trainer.gpus=1", "trainer.max_epochs=1"], workdir)
    ckpt = torch.load(only_run_dir(workdir) / "checkpoints" / "last.pt", map_location="cpu",
                      weights_only=True)
    assert all(t.device.type == "cpu" for t in ckpt["model"].values())


TEXT = "".join(f"the {w} sat on the mat. " for w in ("cat", "dog", "bird", "fox") * 200)


def test_fsdp_nccl_bf16_gpt_with_activation_checkpointing_and_resume(workdir):
    """FSDP over NCCL on one GPU: bf16 parameters with fp32 reduction, the GPT's blocks
    sharded and recomputed in backward; the sharded last.pt resumes and best.pt loads on the
    CPU into the plain model."""
    (workdir / "text.txt").write_text(TEXT)
    args = ["task=lm", "model=gpt", "data=text", "data.path=text.txt", "data.block_size=32",
            "trainer.gpus=1", "trainer.strategy=fsdp", "trainer.precision=bf16",
            "trainer.activation_checkpointing=true", "optimizer=adamw", "trainer.max_steps=30"]
    res = run_cli(args, workdir)
    assert "fsdp: 2 block(s) and the root of GPT sharded over 1 rank(s)" in res.output
    first = only_run_dir(workdir)
    assert read_metrics(first)["status"] == "completed"
    run_cli([*args, "trainer.max_steps=40", f"resume={first}"], workdir)
    from ddpexp.models import GPT

    best = torch.load(first / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    vocab = best["model"]["tok.weight"].shape[0]
    GPT(vocab_size=vocab, block_size=32).load_state_dict(best["model"], strict=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_tensor_parallel_over_nccl_on_every_gpu(workdir, strategy):
    """``trainer.gpus=N trainer.tp=N`` (one replica split over every GPU; NCCL needs a GPU a
    rank, so it takes 2 or more), alone and inside fsdp, in bf16: it trains, its DCP
    checkpoint resumes, and best.pt loads on the CPU into the plain GPT."""
    n = ngpus()
    if n < 2:
        pytest.skip("tensor parallelism over NCCL needs 2 GPUs or more (one rank each)")
    (workdir / "text.txt").write_text(TEXT)
    args = ["task=lm", "model=gpt", "data=text", "data.path=text.txt", "data.block_size=32",
            f"model.n_head={n * 2}", f"model.n_embd={n * 32}", f"trainer.gpus={n}",
            f"trainer.tp={n}", f"trainer.strategy={strategy}", "trainer.precision=bf16",
            "optimizer=adamw", "trainer.max_steps=30"]
    res = run_cli(args, workdir)
    assert f"{n} worker(s): strategy={strategy}, dp=1 x tp={n}, {n} GPU(s) per node" in res.output
    first = only_run_dir(workdir)
    assert read_metrics(first)["status"] == "completed"
    run_cli([*args, "trainer.max_steps=40", f"resume={first}"], workdir)
    from ddpexp.models import GPT

    best = torch.load(first / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    vocab = best["model"]["tok.weight"].shape[0]
    GPT(vocab_size=vocab, block_size=32, n_head=n * 2, n_embd=n * 32).load_state_dict(
        best["model"], strict=True)
