"""``python -m ddpexp.find lr``: the range test's curve is the global loss, the same at 1
worker and at 2 with the same global batch; its files (lr.json, lr.png, TensorBoard scalars)
and printed command; bad input is one message; other runs are left as they were."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from helpers import read_scalars, run_cli

from ddpexp import find

TINY = ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.shape=[1,4,4]",
        "data.num_classes=3", "data.num_samples=256", "data.val_samples=32", "~logger",
        "find.steps=30", "find.lr_min=1e-3", "find.lr_max=3"]


def test_the_curve_is_the_global_loss_at_any_world_size_and_strategy(workdir: Path):
    one = run_cli(["lr", *TINY, "data.batch_size=32", "hydra.run.dir=outputs/one"], workdir,
                  module="ddpexp.find", timeout=180)
    two = run_cli(["lr", *TINY, "trainer.procs=2", "data.batch_size=16", "hydra.run.dir=outputs/two"],
                  workdir, module="ddpexp.find", timeout=180)
    a = json.loads((workdir / "outputs/one/find/lr.json").read_text())
    b = json.loads((workdir / "outputs/two/find/lr.json").read_text())
    assert len(a["lr"]) == len(a["loss"]) == 30 and a["lr"] == b["lr"]
    assert a["lr"][0] == pytest.approx(1e-3) and a["lr"][-1] == pytest.approx(3)
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a["loss"], b["loss"], strict=True))
    assert a["suggested_lr"] == b["suggested_lr"] and 1e-3 < a["suggested_lr"] < 3
    # The plot, TensorBoard's scalars (read with its own reader) and the printed command.
    assert (workdir / "outputs/one/find/lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scalars = read_scalars(workdir / "outputs/two/tb")
    assert [v for _, v in scalars["find/loss"]] == pytest.approx(b["loss"])
    lr = f"{a['suggested_lr']:.3g}"
    assert f"suggested lr: {lr}" in one.stdout and f"suggested lr: {lr}" in two.stdout
    command = two.stdout.split("sweep around it with:\n", 1)[1].splitlines()[0].strip()
    assert command.startswith("python -m ddpexp -m model=mlp") and "trainer.procs=2" in command
    assert command.endswith(",".join(f"{a['suggested_lr'] * k:.2g}" for k in (1 / 3, 1, 3)))
    assert "2 worker(s)" in two.stdout
    # FSDP's shards reduce the same gradients: the same curve again.
    run_cli(["lr", *TINY, "trainer.procs=2", "trainer.strategy=fsdp", "data.batch_size=16",
             "hydra.run.dir=outputs/fsdp"], workdir, module="ddpexp.find", timeout=180)
    c = json.loads((workdir / "outputs/fsdp/find/lr.json").read_text())
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a["loss"], c["loss"], strict=True))
    assert c["lr"] == a["lr"] and c["suggested_lr"] == a["suggested_lr"]


@pytest.mark.parametrize("args, message", [
    (["find.lr_min=1", "find.lr_max=0.1"], "find.lr_min=1.0 must be below find.lr_max=0.1"),
    (["find.steps=5"], "find.steps=5 is too few to fit a curve: give at least 20"),
    (["find.step=50"], "find.step: no such key of find lr; did you mean find.steps?"),
    (["-m", "optimizer.lr=0.1,0.2"], "not a sweep (-m)"),
    (["resume=outputs/x"], "it resumes nothing"),
    (["data.noise=nan"], "nan"),
])
def test_bad_input_is_one_message(tmp_path: Path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    code = find.main(["lr", *TINY[:7], *args])
    err = capsys.readouterr().err
    assert code == 1 and message in (err.lower() if message == "nan" else err), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_search_leaves_other_runs_as_they_were(workdir: Path, monkeypatch, capsys):
    from helpers import run_cli_here

    code, text = run_cli_here([*TINY[:8], "trainer.max_epochs=1", "hydra.run.dir=outputs/run"],
                              workdir, monkeypatch, capsys)
    assert code == 0, text
    before = {p: p.read_bytes() for p in (workdir / "outputs").rglob("*") if p.is_file()}
    assert find.main(["lr", *TINY]) == 0
    after = {p: p.read_bytes() for p in (workdir / "outputs").rglob("*")
             if p.is_file() and "find" not in p.relative_to(workdir / "outputs").parts}
    assert after == before
    [searched] = (workdir / "outputs" / "find").glob("*/*")
    assert (searched / "find" / "lr.json").is_file() and not list(searched.rglob("*.pt"))


PLUGINS_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [
    str(Path(__file__).parents[1] / "plugins"), os.environ.get("PYTHONPATH")]))}
OOM = ["model=mlp", "model._target_=oom.OutOfMemoryAbove", "+model.limit=12", "model.hidden=[16]",
       "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=128",
       "data.val_samples=32", "data.batch_size=2", "~logger", "trainer.procs=2",
       "find.max_batch=64", "find.trial_steps=2"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_find_batch_at_two_workers_agrees_below_a_rank_that_runs_out_of_memory(workdir: Path,
                                                                               strategy: str):
    """Under fsdp rank 1 fails inside a forward whose parameter gathers rank 0 goes on into:
    the search regroups after each failed size and reaches the same verdicts."""
    # Under fsdp, one failed size (each costs a regroup, and on gloo a bounded wait).
    limit, verdicts = (12, VERDICTS) if strategy == "ddp" else (15, FSDP_VERDICTS)
    # run_cli: exit 0 within the timeout, and no process left behind.
    res = run_cli(["batch", *OOM, f"model.limit={limit}", f"trainer.strategy={strategy}",
                   "hydra.run.dir=outputs/b"], workdir, module="ddpexp.find", env=PLUGINS_ENV,
                  timeout=120)
    record = json.loads((workdir / "outputs/b/find/batch.json").read_text())
    assert record["batch_size"] == limit and record["limited_by"] == "memory", record
    assert {t["batch_size"]: t["fits"] for t in record["tried"]} == verdicts
    assert record["regrouped"] == (0 if strategy == "ddp" else 1)
    assert all(t["samples_per_s"] > 0 for t in record["tried"] if t["fits"])
    assert f"largest per-worker batch: data.batch_size={limit} (limited by memory)" in res.stdout
    if strategy == "ddp":
        assert "linear optimizer.lr=0.3" in res.stdout
        assert "square root optimizer.lr=0.122" in res.stdout


def test_find_batch_where_not_even_one_sample_fits_is_one_message(workdir: Path):
    res = run_cli(["batch", *OOM, "model.limit=0", "hydra.run.dir=outputs/b"], workdir,
                  module="ddpexp.find", env=PLUGINS_ENV, timeout=120, expect_ok=False)
    assert res.returncode == 1, res.output
    assert res.stderr.strip().splitlines()[-1].startswith(
        "error: not even data.batch_size=1 fits: a single sample runs out of memory"), res.stderr
    assert "Traceback" not in res.output
    assert not (workdir / "outputs/b/find/batch.json").exists()


VERDICTS = {1: True, 2: True, 4: True, 8: True, 16: False, 12: True, 14: False, 13: False}
FSDP_VERDICTS = {1: True, 2: True, 4: True, 8: True, 16: False, 12: True, 14: True, 15: True}


def _searches(rank: int, port: int, run_dir: str, out) -> None:
    """One rank of a 2-worker gloo world: the batch search 20 times in a row in one process
    group, each search's verdicts put on ``out``."""
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    tests = Path(__file__).parents[1]
    sys.path[:0] = [str(tests / "plugins"), str(tests)]
    from helpers.build import compose_config

    from ddpexp.modes.find_batch import FindBatch, Trials, search
    from ddpexp.runtime import dist as d
    from ddpexp.training.trainer import Trainer

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        plain = compose_config("trainer.progress_bar=false", *OOM[:-3])
        plain["trainer"].update(strategy="ddp", procs=2)
        ctx = d.with_mesh(d.DistContext(rank=rank, world_size=2, local_rank=rank,
                                        local_world_size=2))
        trainer = Trainer.from_config(plain, ctx, Path(run_dir))
        for _ in range(20):
            record = search(Trials(trainer, None), FindBatch(max_batch=64, trial_steps=2))
            out.put((rank, record["batch_size"],
                     {t["batch_size"]: t["fits"] for t in record["tried"]}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_searches_in_a_row_agree_on_every_rank_and_never_hang(tmp_path: Path):
    import multiprocessing as mp
    import time

    from ddpexp.runtime.dist import free_port

    # Fresh interpreters: a fork of a test process (its threads, their locks) may hang.
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_searches, args=(r, port, str(tmp_path / "run"), out))
             for r in (0, 1)]
    began = time.monotonic()
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=120) for _ in range(40)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert time.monotonic() - began < 240
    assert all(p.exitcode == 0 for p in procs)
    for rank in (0, 1):
        mine = [(size, verdicts) for r, size, verdicts in got if r == rank]
        assert mine == [(12, VERDICTS)] * 20
