"""The test split after training and ``python -m ddpexp.eval``: best.pt's test metrics in
metrics.json, TensorBoard and the log, equal to what ddpexp.eval prints with 1 and 2 workers;
an odd-sized test split over 2 workers counted exactly; ddpexp.eval on a checkpoint file
with data.root=..., on a truncated file and on a sweep dir; a 2 lr x 3 seed sweep grouped by
seed."""

from __future__ import annotations

import csv
import io
import json
import shutil
import statistics
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import build_trainer, read_metrics, read_scalars, run_cli, run_dirs, write_mnist
from hydra.utils import instantiate

SYN = ["data=synthetic", "data.num_samples=64", "data.val_samples=16", "data.shape=[6]",
       "data.num_classes=3", "data.batch_size=8", "model=mlp", "model.hidden=[16]"]


def eval_main(*args: str) -> tuple[int, str, str]:
    """``python -m ddpexp.eval ARGS`` in this process (one worker runs in-process)."""
    from ddpexp import eval as ddpexp_eval

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = ddpexp_eval.main(list(args))
    return code, out.getvalue(), err.getvalue()


def records(run_dir: Path) -> list[dict]:
    """The eval-<time>.json files of a run dir, oldest first."""
    files = sorted(run_dir.glob("eval-*.json"), key=lambda p: p.stat().st_mtime_ns)
    return [json.loads(p.read_text()) for p in files]


def by_hand(ckpt: Path, dataset) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of a checkpoint's weights over a whole dataset."""
    state = torch.load(ckpt, weights_only=True)
    model = instantiate(state["config"]["model"])
    model.load_state_dict(state["model"])
    model.eval()
    with torch.no_grad():
        logits = model(dataset.x)
    acc = (logits.argmax(1) == dataset.y).sum().item() / len(dataset)
    return acc, torch.nn.functional.cross_entropy(logits, dataset.y).item()


def test_default_run_tests_best_pt_and_eval_prints_the_same(tmp_path: Path):
    """Monitoring val/loss with mode max keeps epoch 0 as best.pt while val/loss falls, so
    the test must use best.pt's weights, not the last ones."""
    from ddpexp.data import Digits

    run = tmp_path / "run"
    build_trainer(run, ["trainer.max_epochs=2", "trainer.monitor=val/loss",
                        "trainer.monitor_mode=max"]).fit()
    m = read_metrics(run)
    assert m["epochs"] == 2 and m["best"]["epoch"] == 0 and m["test"]["epoch"] == 0
    assert set(m["test"]) == {"test/loss", "test/acc", "epoch"}
    test = Digits().load()[2]
    acc, loss = by_hand(run / "checkpoints" / "best.pt", test)
    assert m["test"]["test/acc"] == pytest.approx(acc, rel=1e-12)
    assert m["test"]["test/loss"] == pytest.approx(loss, rel=1e-5)
    assert by_hand(run / "checkpoints" / "last.pt", test)[1] != pytest.approx(loss, rel=1e-5)
    scalars = read_scalars(run / "tb")
    assert scalars["test/acc"] == [(m["steps"], pytest.approx(acc, abs=1e-6))]
    # The selection value stays validation's.
    assert "val/loss" in m["best"] and not any(k.startswith("test") for k in m["best"])

    code, out, err = eval_main(str(run))
    assert code == 0, err
    assert f"{m['test']['test/acc']:.4f}" in out and f"{m['test']['test/loss']:.4f}" in out
    (one,) = records(run)
    assert one["metrics"] == {k: v for k, v in m["test"].items() if k != "epoch"}
    assert (one["epoch"], one["samples"], one["world_size"], one["split"]) == (0, 180, 1, "test")

    res = run_cli([str(run), "trainer.procs=2"], tmp_path, module="ddpexp.eval", timeout=120)
    two = records(run)[-1]
    assert two["world_size"] == 2 and two["samples"] == 180
    assert two["metrics"]["test/acc"] == pytest.approx(m["test"]["test/acc"], rel=1e-12)
    assert two["metrics"]["test/loss"] == pytest.approx(m["test"]["test/loss"], rel=1e-6)
    assert f"{m['test']['test/acc']:.4f}" in res.stdout and "Traceback" not in res.stderr


def test_trainer_test_false_skips_the_test(tmp_path: Path):
    build_trainer(tmp_path / "run", [*SYN, "trainer.max_epochs=1", "trainer.test=false"]).fit()
    m = read_metrics(tmp_path / "run")
    assert m["status"] == "completed" and "test" not in m
    assert not any(t.startswith("test/") for t in read_scalars(tmp_path / "run" / "tb"))
    # Data without a test split: the run skips the test, ddpexp.eval says what to do instead.
    build_trainer(tmp_path / "none", [*SYN, "trainer.max_epochs=1", "data.test_samples=0"]).fit()
    assert "test" not in read_metrics(tmp_path / "none")
    code, out, err = eval_main(str(tmp_path / "none"))
    assert code == 1 and "data=Synthetic has no test split; evaluate split=val" in err
    code, out, err = eval_main(str(tmp_path / "none"), "split=val")
    assert code == 0 and records(tmp_path / "none")[0]["samples"] == 16


@pytest.mark.slow
def test_odd_test_split_over_two_workers_counts_each_sample_once(workdir: Path):
    from ddpexp.data import Synthetic

    res = run_cli([*SYN, "data.test_samples=101", "trainer.procs=2", "trainer.max_epochs=1"],
                  workdir, timeout=150)
    (run,) = run_dirs(workdir / "outputs")
    m = read_metrics(run)
    assert m["world_size"] == 2 and m["test"]["epoch"] == 0
    test = Synthetic(num_samples=64, val_samples=16, test_samples=101, shape=[6],
                     num_classes=3).load()[2]
    acc, loss = by_hand(run / "checkpoints" / "best.pt", test)
    assert m["test"]["test/acc"] == pytest.approx(acc, rel=1e-12)  # over 101, not 102 padded
    assert m["test"]["test/loss"] == pytest.approx(loss, rel=1e-5)
    assert "test (best.pt, epoch 0, 101 samples)" in res.stdout
    assert f"test/acc {acc:.4f}; run dir" in res.stdout  # the line that ends the run
    code, out, err = eval_main(str(run))
    assert code == 0, err
    assert records(run)[0]["metrics"] == {k: v for k, v in m["test"].items() if k != "epoch"}


def test_eval_checkpoint_file_with_data_root_and_bad_files(tmp_path: Path):
    write_mnist(tmp_path / "a", n_train=40, n_test=13, size=(8, 8))
    run = tmp_path / "run"
    build_trainer(run, ["data=mnist", f"data.root={tmp_path / 'a'}", "data.shape=[1,8,8]",
                        "model=mlp", "model.hidden=[8]", "trainer.max_epochs=1"]).fit()
    shutil.move(tmp_path / "a", tmp_path / "moved")
    last = run / "checkpoints" / "last.pt"
    code, out, err = eval_main(str(last))
    assert code == 1 and "missing from" in err and "Traceback" not in err
    code, out, err = eval_main(str(last), f"data.root={tmp_path / 'moved'}", "split=val")
    assert code == 0, err
    assert records(run)[0]["split"] == "val" and records(run)[0]["samples"] == 4
    assert "val/acc" in out
    code, out, err = eval_main(str(last), f"data.root={tmp_path / 'moved'}")
    assert code == 0 and records(run)[-1]["samples"] == 13

    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(last.read_bytes()[:2000])
    code, out, err = eval_main(str(truncated))
    assert code == 1 and f"checkpoint {truncated} is truncated or corrupt" in err
    assert err.count("\n") == 1 and out == ""
    assert "The run has no other checkpoint beside it to evaluate." in err
    # A corrupt last.pt of the run: the advice names the run's other checkpoint, not itself.
    good = last.read_bytes()
    last.write_bytes(good[:2000])
    code, out, err = eval_main(str(last))
    assert code == 1 and f"python -m ddpexp.eval {run / 'checkpoints' / 'best.pt'}" in err, err
    assert f"python -m ddpexp.eval {last}" not in err
    last.write_bytes(good)
    (run / "checkpoints" / "best.pt").unlink()
    code, out, err = eval_main(str(run))
    assert code == 1 and f"{run / 'checkpoints' / 'best.pt'} does not exist" in err
    code, out, err = eval_main(str(last), "split=train")
    assert code == 1 and "split=train is not one of test, val" in err
    code, out, err = eval_main(str(last), f"data.root={tmp_path / 'moved'}", "data.test_fraction=0")
    assert code == 1 and "data.test_fraction is not a key of the run's config; did you mean " \
        "data.val_fraction? (or use +data.test_fraction=0 to add it)" in err


@pytest.mark.slow
def test_seed_sweep_is_grouped_and_every_job_evaluated(workdir: Path):
    """2 learning rates x 3 seeds: summary_by_seed has 2 rows of n=3 whose means are the
    means of the jobs' metrics.json; ddpexp.eval on the sweep dir gives one row per job."""
    from ddpexp import report

    run_cli(["-m", *SYN, "trainer.max_epochs=1", "optimizer.lr=0.05,0.2", "seed=0,1,2",
             "hydra.launcher.max_parallel=2"],
            workdir, timeout=240)
    (sweep,) = {d.parent for d in run_dirs(workdir / "outputs")}
    rows = list(csv.DictReader((sweep / "summary_by_seed.csv").open()))
    assert [(r["n"], r["seeds"]) for r in rows] == [("3", "0 1 2")] * 2
    for r in rows:
        jobs = [read_metrics(sweep / j) for j in r["jobs"].split()]
        assert [j["status"] for j in jobs] == ["completed"] * 3
        for col, get in (("best", lambda j: j["best"]["val/acc"]),
                         ("test", lambda j: j["test"]["test/acc"])):
            values = [get(j) for j in jobs]
            assert float(r[f"{col}_mean"]) == pytest.approx(statistics.fmean(values))
            assert float(r[f"{col}_std"]) == pytest.approx(statistics.stdev(values))
    assert sorted(r["overrides"].split()[-1] for r in rows) == ["optimizer.lr=0.05", "optimizer.lr=0.2"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert report.main([str(sweep), "--group-seeds"]) == 0
    assert len(out.getvalue().splitlines()) == 3 and " ± " in out.getvalue()

    code, out, err = eval_main(str(sweep))
    assert code == 0, err
    # The table (a header and a row per job), then a line per job saying what it evaluated.
    lines = out.splitlines()
    assert len(lines) == 1 + 6 + 6
    assert all(" on the test split: the whole split, " in line for line in lines[7:])
    for job in range(6):
        (rec,) = records(sweep / str(job))
        assert rec["metrics"]["test/acc"] == pytest.approx(
            read_metrics(sweep / str(job))["test"]["test/acc"], rel=1e-12)


def test_eval_takes_the_whole_split_whatever_the_training_run_limited(tmp_path: Path):
    run = tmp_path / "run"
    build_trainer(run, [*SYN, "data.test_samples=40", "trainer.max_epochs=1",
                        "trainer.limit_val_batches=2"]).fit()
    assert read_metrics(run)["test"]  # the run's own test, cut to 2 batches of 8
    code, out, err = eval_main(str(run))
    assert code == 0, err
    (whole,) = records(run)
    assert whole["samples"] == 40 and whole["limit_val_batches"] is None
    assert f"run: {run / 'checkpoints' / 'best.pt'} (epoch 0) on the test split: the whole split, " \
           "40 samples, 1 worker(s)" in out
    code, out, err = eval_main(str(run), "trainer.limit_val_batches=2")
    assert code == 0, err
    assert records(run)[-1]["samples"] == 16
    assert "its first 2 batch(es) per worker (trainer.limit_val_batches=2), 16 samples" in out
