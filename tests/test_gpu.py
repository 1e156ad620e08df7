"""GPU paths: NCCL DDP, DataParallel, mixed precision and torch.compile. They run where CUDA
exists and are skipped elsewhere (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import only_run_dir, read_metrics, run_cli

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
