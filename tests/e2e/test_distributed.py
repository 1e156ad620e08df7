"""Distributed runs with real processes: gloo DDP on CPU, failures that end the run, restarts,
concurrent runs, two "nodes" over loopback, and ranks started by SLURM."""

from __future__ import annotations

import csv
import os
import re
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    finish,
    only_run_dir,
    read_metrics,
    read_scalars,
    run_cli,
    run_cli_in_process,
    run_dirs,
    start_cli,
)

PLUGINS = str(Path(__file__).parents[1] / "plugins")
# 256 train samples: 2 batches of 64 per rank and epoch at world size 2.
TINY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=256",
        "data.val_samples=101", "model=mlp", "model.hidden=[16]", "trainer.log_every_n_steps=1"]
DDP2 = ["trainer.procs=2"]

pytestmark = pytest.mark.slow


def plugin_env() -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}


def faulty(mode: str, **kw) -> list[str]:
    args = ["model._target_=faulty.Faulty", f"+model.mode={mode}"]
    return args + [f"+model.{k}={v}" for k, v in kw.items()]


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def assert_same_tensors(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=False):
            assert_same_tensors(x, y)
    else:
        assert a == b


def test_two_workers_one_run_dir_rank0_writes(workdir):
    res = run_cli([*TINY, *DDP2, "trainer.max_epochs=2"], workdir)
    run_dir = only_run_dir(workdir)
    m = read_metrics(run_dir)
    assert m["world_size"] == 2 and m["status"] == "completed" and m["epochs"] == 2
    # Exactly one writer: one events file, one set of checkpoints, nothing else in the dir.
    assert len(list((run_dir / "tb").iterdir())) == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best.pt", "best.pt.sha256", "last.pt", "last.pt.sha256"]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".hydra", "checkpoints", "ddpexp.log", "metrics.json", "provenance.json", "tb"]
    assert "[rank1]" not in (run_dir / "ddpexp.log").read_text()
    assert "2 worker(s): strategy=ddp" in res.output
    # 2 batches per rank and epoch -> 4 optimizer steps in all, logged once each.
    assert [s for s, _ in read_scalars(run_dir / "tb")["train/loss"]] == [1, 2, 3, 4]


def test_same_seed_same_weights_and_exact_validation(workdir):
    from ddpexp.data import Synthetic
    from ddpexp.models import MLP

    for _ in range(2):
        run_cli([*TINY, *DDP2, "trainer.max_epochs=2", "seed=3"], workdir)
    first, second = run_dirs(workdir / "outputs")
    a, b = final_state(first), final_state(second)
    assert_same_tensors(a["model"], b["model"])
    assert_same_tensors(a["optimizer"], b["optimizer"])
    # 101 validation samples over 2 ranks: counted once each, as one process would (to the
    # rounding of float64 sums of per-batch means; one sample more or less is 1/101 off).
    model = MLP([6], 3, hidden=[16])
    model.load_state_dict(a["model"])
    model.eval()
    _, val, _ = Synthetic(shape=[6], num_classes=3, num_samples=256, val_samples=101).load()
    with torch.no_grad():
        correct = (model(val.x).argmax(1) == val.y).sum().item()
    assert read_metrics(first)["final"]["val/acc"] == pytest.approx(correct / 101, rel=1e-12)


@pytest.mark.parametrize("mode, cause", [
    ("raise", ("rank 1 (pid",)),
    # The agent may see rank 0's broken connection first; rank 1 is named either way.
    ("kill", ("was killed by SIGKILL", "rank 1 was killed by a signal")),
])
def test_failing_rank_ends_the_run(workdir, mode, cause):
    started = time.time()
    res = run_cli([*TINY, *DDP2, *faulty(mode)], workdir, env=plugin_env(), expect_ok=False, timeout=90)
    assert res.returncode != 0
    assert time.time() - started < 60
    assert any(c in res.stderr for c in cause), res.stderr
    if mode == "raise":
        assert "RuntimeError: injected failure on rank 1" in res.stderr
        assert "Traceback" not in res.stderr  # the traceback is in the run's log instead
        log = (only_run_dir(workdir) / "ddpexp.log").read_text()
        assert "Traceback" in log and "injected failure" in log
    assert read_metrics(only_run_dir(workdir))["status"] == "failed"


def test_stalled_rank_is_named_with_its_stack(workdir):
    # Rank 1 hangs in its model's forward (outside any collective) at its 3rd call.
    started = time.time()
    tmp = workdir / "tmp"  # where torch elastic and the watchdog keep their files
    tmp.mkdir()
    res = run_cli([*TINY, *DDP2, *faulty("stall"), "trainer.dist_timeout_s=5"], workdir,
                  env={**plugin_env(), "TMPDIR": str(tmp)}, expect_ok=False, timeout=90)
    took = time.time() - started
    # No torch elastic dir left behind (torch's own caches, torchinductor_*, may stay).
    assert not [p.name for p in tmp.iterdir() if "elastic" in p.name]
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "a worker stalled, so the whole run was stopped:" in res.stderr
    found = re.search(r"rank 1 \(pid \d+\) stalled in forward at step (\d+): no progress for (\d+) s",
                      res.stderr)
    assert found, res.stderr
    assert 5 <= int(found.group(2)) <= 15  # trainer.dist_timeout_s, then the run is gone
    assert "rank 0 waited" in res.stderr and "Timed out" not in res.stderr
    assert took < 60  # start-up included
    run_dir = only_run_dir(workdir)
    log = (run_dir / "ddpexp.log").read_text()
    stack = log.split("[rank1] stalled in forward", 1)[1]
    assert "most recent call first" in stack and "faulty.py" in stack and "in forward" in stack
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "failed" and "rank 1" in metrics["error"]


def test_stalled_rank_in_a_sweep_is_named_in_its_row(workdir):
    sweep_dir = workdir / "sweep"
    res = run_cli(["-m", *TINY, *DDP2, *faulty("stall"), "trainer.dist_timeout_s=5",
                   f"hydra.sweep.dir={sweep_dir}"], workdir, env=plugin_env(), expect_ok=False,
                  timeout=120)
    assert res.returncode != 0
    with (sweep_dir / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["status"] == "failed"
    assert re.search(r"rank 1 \(pid \d+\) stalled in forward at step \d+", row["error"])
    assert "[rank1] stalled in forward" in (sweep_dir / "0" / "ddpexp.log").read_text()


def test_restart_resumes_from_last_checkpoint(workdir):
    # Rank 1 dies once at its 3rd forward (epoch 1); the group restarts from epoch 1's start.
    args = [*TINY, *DDP2, "trainer.max_epochs=3", "seed=5"]
    res = run_cli([*args, *faulty("kill", first_attempt_only="true"), "trainer.max_restarts=1"],
                  workdir, env=plugin_env(), timeout=150)
    assert "restart 1 of the worker group: resuming from" in res.output
    restarted = only_run_dir(workdir)
    assert read_metrics(restarted)["status"] == "completed"
    # The same run without the failure ends with the very same weights.
    run_cli([*args, *faulty("none")], workdir, env=plugin_env())
    clean = [d for d in run_dirs(workdir / "outputs") if d != restarted][0]
    assert_same_tensors(final_state(restarted)["model"], final_state(clean)["model"])


def test_two_concurrent_runs_pick_their_own_ports(workdir):
    procs = [start_cli([*TINY, *DDP2, "trainer.max_epochs=1"], workdir) for _ in range(2)]
    for res in [finish(p, 150) for p in procs]:
        assert res.returncode == 0, res.stderr
        assert not res.leftovers
    assert len(run_dirs(workdir / "outputs")) == 2


def test_two_nodes_over_loopback(workdir):
    from ddpexp.runtime.dist import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    common = [*TINY, "trainer.nodes=2", "trainer.procs=1", f"trainer.rdzv_endpoint={endpoint}",
              "trainer.max_epochs=1"]
    procs = [start_cli([*common, f"hydra.run.dir=node{n}"], workdir) for n in range(2)]
    results = [finish(p, 150) for p in procs]
    for res in results:
        assert res.returncode == 0, res.stderr
        assert not res.leftovers
    written = [d for d in (workdir / "node0", workdir / "node1") if (d / "metrics.json").exists()]
    assert len(written) == 1  # only the node that got global rank 0 writes
    assert read_metrics(written[0])["world_size"] == 2


def test_slurm_ranks_are_used_instead_of_spawning(workdir):
    from ddpexp.runtime.dist import free_port

    port = free_port()
    procs = []
    for rank in range(2):
        env = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(start_cli([*TINY, "trainer.max_epochs=1", "hydra.run.dir=slurm_run"], workdir, env=env))
    results = [finish(p, 150) for p in procs]
    for res in results:
        assert res.returncode == 0, res.stderr
    m = read_metrics(workdir / "slurm_run")
    assert m["world_size"] == 2 and m["status"] == "completed"
    # Each SLURM task is one rank: no elastic agent, no extra worker processes.
    assert "2 worker(s) (SLURM tasks): strategy=ddp" in results[0].output
    # ...and together they train exactly as the 2 workers torch elastic would start.
    run_cli([*TINY, *DDP2, "trainer.max_epochs=1", "hydra.run.dir=elastic_run"], workdir)
    assert_same_tensors(final_state(workdir / "slurm_run")["model"],
                        final_state(workdir / "elastic_run")["model"])


def test_too_many_gpus_fails_at_once(workdir):
    started = time.time()
    res = run_cli(["trainer.gpus=4"], workdir, expect_ok=False, timeout=60)
    assert res.returncode != 0
    assert "trainer.gpus=4 but 0 GPU(s) are visible" in res.stderr
    assert "trainer.gpus=0" in res.stderr
    assert time.time() - started < 30


def test_dp_strategy_runs_one_process_on_cpu(workdir):
    res = run_cli_in_process([*TINY, "trainer.strategy=dp", "trainer.max_epochs=1"], workdir)
    assert "1 worker(s): strategy=dp" in res.output
    assert read_metrics(only_run_dir(workdir))["world_size"] == 1


def test_ddp_strategy_with_one_worker(workdir):
    res = run_cli_in_process([*TINY, "trainer.strategy=ddp", "trainer.max_epochs=1"], workdir)
    assert "1 worker(s): strategy=ddp" in res.output
    assert read_metrics(only_run_dir(workdir))["status"] == "completed"
