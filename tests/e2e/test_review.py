"""Reviewing runs: what TensorBoard shows (read back with TensorBoard's own reader: every
scalar of a run, the HParams data of each job of a sweep, matched against metrics.json) and
the report's table and plot of a real sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import read_metrics, run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

TINY = ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.shape=[6]", "data.num_classes=3",
        "data.num_samples=256", "data.val_samples=64", "trainer.max_epochs=3",
        "trainer.log_every_n_steps=2"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("tb")
    run_cli(["-m", "optimizer.lr=0.01,0.2", "optimizer=sgd,adam", *TINY, "hydra.sweep.dir=sweep"],
            cwd, timeout=300)
    return cwd / "sweep"


def accumulator(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_every_scalar_of_a_run(sweep):
    run_dir = sweep / "0"
    m = read_metrics(run_dir)
    acc = accumulator(run_dir)
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    per_step = ["train/loss", "train/acc", "train/samples_per_s", "train/grad_norm", "train/lr"]
    per_epoch = ["val/loss", "val/acc", "epoch/time_s", "best/val/acc"]
    # The lr monitor callback logs at the cadence of the other train scalars.
    assert set(per_step + per_epoch) <= set(scalars)
    steps_per_epoch = m["steps"] // m["epochs"]  # 256 samples / 64 = 4
    for tag in per_step:
        assert [s for s, _ in scalars[tag]] == list(range(2, m["steps"] + 1, 2)), tag
    for tag in per_epoch:
        assert [s for s, _ in scalars[tag]] == [steps_per_epoch * (e + 1) for e in range(m["epochs"])], tag
    for h, (_, acc_value) in zip(m["history"], scalars["val/acc"], strict=False):
        assert acc_value == pytest.approx(h["val/acc"])
    assert scalars["best/val/acc"][-1][1] == pytest.approx(m["best"]["val/acc"])
    assert all(v > 0 for _, v in scalars["train/samples_per_s"] + scalars["train/grad_norm"])
    assert all(v == pytest.approx(0.01) for _, v in scalars["train/lr"])
    # The resolved config as text, no graph, a small file.
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load(text.strip("`").removeprefix("yaml\n"))["optimizer"]["lr"] == 0.01
    assert not acc.Tags()["graph"]
    events = list((run_dir / "tb").iterdir())
    assert len(events) == 1 and events[0].stat().st_size < 64 * 1024


def test_hparams_of_each_sweep_job(sweep):
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 4
    seen = set()
    for job in jobs:
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        acc = accumulator(job)
        content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
        hp = {k: (v.number_value if v.HasField("number_value") else v.string_value)
              for k, v in start.hparams.items()}
        expected = dict(o.split("=", 1) for o in overrides if not o.startswith("hydra"))
        assert set(hp) == set(expected)
        assert hp["optimizer.lr"] == float(expected["optimizer.lr"])
        assert hp["optimizer"] == expected["optimizer"]
        seen.add((hp["optimizer"], hp["optimizer.lr"]))
        assert end.status == 1  # STATUS_SUCCESS
        # The metrics the dashboard shows are the last values of these scalar tags.
        m = read_metrics(job)
        assert acc.Scalars("val/acc")[-1].value == pytest.approx(m["final"]["val/acc"])
        assert acc.Scalars("val/loss")[-1].value == pytest.approx(m["final"]["val/loss"])
        assert acc.Scalars("best/val/acc")[-1].value == pytest.approx(m["best"]["val/acc"])
    assert seen == {("sgd", 0.01), ("sgd", 0.2), ("adam", 0.01), ("adam", 0.2)}


def test_report_on_a_real_sweep(sweep):
    import csv
    import io
    import json
    import subprocess
    import sys

    def report(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ddpexp.report", str(sweep), *args],
                              capture_output=True, text=True, timeout=120, check=True)

    best = {str(j): read_metrics(sweep / str(j))["best"]["val/acc"] for j in range(4)}
    order = sorted(best, key=lambda j: (-best[j], int(j)))
    rows = json.loads(report("--format", "json").stdout)
    assert [r["job"] for r in rows] == order
    assert [r["best"] for r in rows] == [pytest.approx(best[j]) for j in order]
    assert all(r["status"] == "completed" and r["epochs"] == 3 for r in rows)
    table = list(csv.DictReader(io.StringIO(report("--format", "csv").stdout)))
    assert [r["job"] for r in table] == order and "optimizer.lr=" in table[0]["overrides"]
    md = report("--format", "md").stdout.splitlines()
    assert md[0].startswith("| job | overrides | status | final val/acc | best val/acc |")
    assert len(md) == 2 + 4
    text = report().stdout.splitlines()
    assert text[0].split()[:3] == ["job", "overrides", "status"] and len(text) == 5
    # The sweep summary the launcher wrote holds the same rows in the same order.
    summary = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["job"] for r in summary] == order

    png = sweep.parent / "curves.png"
    res = report("--plot", str(png))
    assert "4 runs, one curve each" in res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[2] in (3, 4)
