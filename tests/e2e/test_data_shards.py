"""``data=shards`` and the elastic data stream: WebDataset tar shards written with the tarfile
module, trained on by real gloo workers and loader workers; the samples each rank trained
on at each step read back from a user callback (tests/plugins/sampleids.py).

A run of 99 samples (7 steps of 2 x 8 an epoch, the last of 3 samples) killed mid-epoch at
2 ranks x 2 loader workers and resumed at 1 rank x 0 workers and at 2 ranks x 1 worker
trains on every sample of each epoch once, in the uninterrupted run's global order; so do
uninterrupted runs at 1 and 2 loader workers."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    build_trainer,
    finish,
    plugins_env,
    read_metrics,
    run_cli_in_process,
    start_cli,
    sweep_cases,
    write_shards,
)

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint.io import load
from ddpexp.errors import ConfigError

N = 99  # 6 shards of 16 and one of 3


def write_data(root: Path) -> Path:
    write_shards(root, shards=6, per_shard=16)
    write_shards(root, shards=1, per_shard=3, prefix="train-tail", first_id=96)
    write_shards(root, shards=1, per_shard=16, prefix="val", first_id=1000)
    return root


def common(root: Path) -> list[str]:
    return ["data=shards", f"data.path={root}", "data.block=2", "model=mlp", "model.hidden=[16]",
            "data.batch_size=8", "trainer.log_every_n_steps=1", "trainer.max_epochs=3",
            "trainer.ckpt_every_steps=1", "trainer.progress_bar=false",
            "+callbacks.ids._target_=sampleids.SampleIds"]


def records(run: Path, upto: int | None = None, after: int | None = None) -> dict[int, dict]:
    """Step -> {"epoch", "ranks": {rank: ids}} of the callback's lines in ``run`` (the steps
    at most ``upto`` or above ``after`` only)."""
    out: dict[int, dict] = {}
    for path in sorted(run.glob("ids.rank*.jsonl")):
        rank = int(path.name.split(".")[1].removeprefix("rank"))
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            step = rec["step"]
            if (upto is not None and step > upto) or (after is not None and step <= after):
                continue
            entry = out.setdefault(step, {"epoch": rec["epoch"], "ranks": {}})
            entry["ranks"][rank] = rec["ids"]
    return out


def global_order(steps: dict[int, dict]) -> dict[int, list[int]]:
    """Epoch -> the samples of its steps in global order: at each step rank r's i-th sample
    is the step's sample i * ranks + r."""
    epochs: dict[int, list[int]] = {}
    for step in sorted(steps):
        ranks = [steps[step]["ranks"][r] for r in sorted(steps[step]["ranks"])]
        longest = max(len(r) for r in ranks)
        dealt = [r[i] for i in range(longest) for r in ranks if i < len(r)]
        epochs.setdefault(steps[step]["epoch"], []).extend(dealt)
    return epochs


def wait_for_step(run: Path, proc, step: int, timeout: float = 120) -> None:
    path = run / "ids.rank0.jsonl"
    deadline = time.time() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= step):
        if proc.poll() is not None or time.time() > deadline:
            res = finish(proc, 10)
            pytest.fail(f"the run never reached step {step} (exit {res.returncode})\n{res.output}")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_stream_killed_mid_epoch_resumes_at_other_ranks_and_workers_seeing_each_sample_once(workdir):
    root = write_data(workdir / "shards")
    base = common(root)
    whole = sweep_cases(workdir, {
        "w2": ["trainer.procs=2", "data.num_workers=2"],
        "w1": ["trainer.procs=2", "data.num_workers=1"],
        "solo": ["trainer.procs=1", "data.num_workers=0", "data.batch_size=16"],
    }, base, timeout=300)
    (workdir / "conf").rename(workdir / "conf-whole")
    (workdir / "sweep").rename(workdir / "sweep-whole")
    whole = {name: workdir / "sweep-whole" / run.name for name, run in whole.items()}
    orders = {name: global_order(records(run)) for name, run in whole.items()}
    for name, order in orders.items():
        assert sorted(order) == [0, 1, 2], name
        for epoch, seen in order.items():
            assert sorted(seen) == list(range(N)), (name, epoch)  # each sample once
    reference = orders["w2"]
    assert reference[0] != reference[1]  # reshuffled each epoch
    # The same seed at 1 and 2 loader workers and at 1 rank of 16: the same global batches.
    assert orders["w1"] == reference and orders["solo"] == reference

    killed = workdir / "killed"
    proc = start_cli([*base, "trainer.procs=2", "data.num_workers=2", f"hydra.run.dir={killed}"],
                     workdir, plugins_env())
    try:
        wait_for_step(killed, proc, 10)  # epoch 1, 3 of its 7 steps
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        res = finish(proc, 30)
    assert res.returncode == -signal.SIGKILL and not res.leftovers
    saved = load(killed / "checkpoints" / "last.pt")
    assert saved["epoch"] == 1 and 0 < saved["batch"] < 7, (saved["epoch"], saved["batch"])
    assert saved["data"] == {"epoch": 1, "samples": saved["batch"] * 16, "seed": 0,
                             "split_samples": N}
    # Each resume is a job of its own run dir, continuing from the killed run's last.pt.
    resumed = sweep_cases(workdir, {
        "solo": [f"resume={killed}", "trainer.procs=1", "data.num_workers=0",
                 "data.batch_size=16"],
        "two": [f"resume={killed}", "trainer.procs=2", "data.num_workers=1"],
    }, base, timeout=300)
    before = records(killed, upto=saved["step"])
    for name, run in resumed.items():
        assert read_metrics(run)["status"] == "completed"
        order = global_order({**before, **records(run, after=saved["step"])})
        for epoch in (0, 1, 2):
            assert sorted(order[epoch]) == list(range(N)), (name, epoch)  # 0 lost, 0 twice
        assert order == reference, name
    # At the world size it was written at, the resume is bit-exact (the worker count changed).
    a = load(whole["w2"] / "checkpoints" / "last.pt")["model"]
    b = load(resumed["two"] / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


AUGMENTED = ["data=shards", "data.input_key=png", "data.block=2", "model=convnet",
             "data.batch_size=8", "data.num_workers=2", "trainer.log_every_n_steps=1",
             "trainer.max_epochs=3", "trainer.progress_bar=false", "model.dropout=0.2",
             "data.train_transform=[{_target_: torchvision.transforms.RandomCrop, size: 12, "
             "padding: 2}, {_target_: torchvision.transforms.RandomHorizontalFlip}]"]


@pytest.mark.slow
def test_an_augmented_run_with_loader_workers_resumes_mid_epoch_bit_exactly(workdir):
    """Random crops and flips in 2 loader workers: 20 steps uninterrupted against 9 (mid-
    epoch 1) resumed to 20, the same weights; and the same weights at 1 loader worker, whose
    one process makes every sample: each sample's draws are its own."""
    root = write_shards(workdir / "shards", shards=4, per_shard=16, images=True)
    base = [*AUGMENTED, f"data.path={root}"]
    first = sweep_cases(workdir, {"whole": ["trainer.max_steps=20"],
                                  "part": ["trainer.max_steps=9"],
                                  "one": ["trainer.max_steps=20", "data.num_workers=1"]},
                        base, timeout=300)
    (workdir / "conf").rename(workdir / "conf-first")
    (workdir / "sweep").rename(workdir / "sweep-first")
    first = {name: workdir / "sweep-first" / run.name for name, run in first.items()}
    assert read_metrics(first["part"])["epochs"] == 1  # stopped inside epoch 1 (of 7 steps)
    again = sweep_cases(workdir, {"part": ["trainer.max_steps=20", f"resume={first['part']}"]},
                        base, timeout=300)["part"]
    whole = load(first["whole"] / "checkpoints" / "last.pt")["model"]
    for other in (load(again / "checkpoints" / "last.pt")["model"],
                  load(first["one"] / "checkpoints" / "last.pt")["model"]):
        assert all(torch.equal(whole[k], other[k]) for k in whole)
    assert read_metrics(again)["final"] == read_metrics(first["whole"])["final"]


def test_a_shard_cut_mid_run_fails_the_run_naming_it_and_keeps_the_last_checkpoint(workdir):
    """A loader worker meets a shard cut short after the run started: the run ends as
    failed with the one message naming the file, and last.pt is the checkpoint before."""
    root = write_shards(workdir / "shards", shards=2, per_shard=16)
    shard = root / "train-001.tar"
    args = ["data=shards", f"data.path={root}", "data.block=1", "data.num_workers=1",
            "model=mlp", "data.batch_size=4", "trainer.max_epochs=2", "trainer.ckpt_every_steps=2",
            "trainer.progress_bar=false", "+callbacks.cut._target_=shardfault.CutShard",
            f"+callbacks.cut.path={shard}", "+callbacks.cut.at=2", "hydra.run.dir=run"]
    res = run_cli_in_process(args, workdir, env=plugins_env(), expect_ok=False)
    assert res.returncode == 1
    assert f"data=shards: the shard {shard} is shorter than its index says" in res.output
    assert "Original Traceback" not in res.output and "Traceback" not in res.stderr
    assert read_metrics(workdir / "run")["status"] == "failed"
    last = workdir / "run" / "checkpoints" / "last.pt"
    ckpt_files.check_digest(last)
    assert load(last)["step"] >= 2


def test_bad_shards_get_one_message_each(tmp_path):
    """A missing directory, no training shards (naming what is there), a sample without its
    input member (naming the members it has), an empty split, an unreadable shard."""
    from ddpexp.data.shards import Shards

    def refused(path: Path, **kwargs) -> str:
        with pytest.raises(ConfigError) as info:
            Shards(path=str(path), **kwargs).load()
        return str(info.value)

    assert "is not a directory of tar shards" in refused(tmp_path / "nowhere")
    root = write_shards(tmp_path / "shards", shards=1, per_shard=4)
    message = refused(root, train="training-*.tar")
    assert "no training shards data.train='training-*.tar'" in message and "train-000.tar" in message
    message = refused(root, input_key="png")
    assert "has no 'png' member (data.input_key); its members: cls, npy" in message
    (tmp_path / "empty").mkdir()
    import tarfile

    with tarfile.open(tmp_path / "empty" / "train-000.tar", "w"):
        pass
    assert "the train split (train*.tar in" in refused(tmp_path / "empty") \
        and "has no samples" in refused(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train-000.tar").write_bytes(b"not a tar file" * 10)
    assert f"cannot read the shard {tmp_path / 'bad' / 'train-000.tar'}" in refused(tmp_path / "bad")


def test_shards_train_in_process_and_read_shape_and_classes(tmp_path, caplog):
    """A trainer over tar shards: shape and classes read off the samples, 10% held out for
    validation where there are no val shards, each sample in one part; more readers than
    shards is one warning saying how the samples are dealt out."""
    from ddpexp.data.shards import Shards

    root = write_shards(tmp_path / "shards", shards=1, per_shard=40)
    source = Shards(path=str(root), batch_size=4)
    train, val = source.load()
    assert (len(train), len(val)) == (36, 4) and source.shape == (6,) and source.num_classes == 3
    ids = [round(float(train[i][0][0]) * 1024) for i in range(36)] + \
          [round(float(val[i][0][0]) * 1024) for i in range(4)]
    assert sorted(ids) == list(range(40))
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        trainer = build_trainer(tmp_path / "run", ["data=shards", f"data.path={root}",
                                                   "data.num_workers=2", "model=mlp",
                                                   "trainer.max_epochs=1"])
    assert "1 data-parallel ranks x 2 loader workers = 2 readers of 1 training shards: the " \
           "samples are dealt out by global batch" in caplog.text
    result = trainer.fit()
    assert result["status"] == "completed" and result["steps"] == 1
