"""The table of runs (report.py): rows read from run dirs, sorted, formatted, grouped by seed."""

from __future__ import annotations

import csv
import io
import json

import pytest
import yaml

from ddpexp import report
from ddpexp.record import write_metrics


def make_run(root, name, *, overrides=(), seed=0, status="completed", acc=0.5, mode="max",
             test=None, extra=None):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
    record = {"status": status, "monitor": "val/acc", "monitor_mode": mode, "epochs": 2, "steps": 8,
              "final": {"val/acc": acc, "val/loss": 1 - acc, **(extra or {})},
              "best": {"val/acc": acc + 0.1, "epoch": 1}, "wall_time_s": 3.25}
    if test is not None:
        record["test"] = {"test/acc": test, "test/loss": 0.4, "epoch": 1}
    write_metrics(d, record)
    return d


def test_read_run(tmp_path):
    d = make_run(tmp_path, "3", overrides=["model=mlp", "resume=auto"], seed=7, test=0.55)
    row = report.read_run(d)
    assert (row.job, row.status, row.monitor, row.final, row.best, row.test) == (
        "3", "completed", "val/acc", 0.5, 0.6, 0.55)
    assert row.overrides == ["model=mlp"] and row.seed == 7
    assert row.metrics == {"val/acc": 0.5, "val/loss": 0.5, "test/acc": 0.55, "test/loss": 0.4}
    assert (row.epochs, row.steps, row.wall_time_s) == (2, 8, 3.25)


def test_read_run_without_or_with_bad_record(tmp_path):
    (tmp_path / "a").mkdir()
    assert report.read_run(tmp_path / "a").status == report.NO_METRICS
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.json").write_text("not json")
    row = report.read_run(tmp_path / "b")
    assert row.status == "unreadable" and "metrics.json" in row.error


def test_test_name():
    assert report.test_name("val/acc") == "test/acc"
    assert report.test_name("loss") == "loss"


def test_collect_sorts_best_first_natural_order(tmp_path):
    for job, acc in (("0", 0.2), ("1", 0.9), ("10", 0.5), ("2", 0.5)):
        make_run(tmp_path, job, overrides=[f"x={job}"], acc=acc)
    (tmp_path / "11").mkdir()
    (tmp_path / "11" / "metrics.json").write_text("{}")
    (tmp_path / "debug" / "d").mkdir(parents=True)
    (tmp_path / "debug" / "d" / "metrics.json").write_text("{}")
    rows = report.collect(tmp_path)
    assert [r.job for r in rows] == ["1", "2", "10", "0", "11"]


def test_sort_rows_min_mode(tmp_path):
    rows = [report.Row(job="a", best=0.3, monitor_mode="min"), report.Row(job="b", best=0.1, monitor_mode="min"),
            report.Row(job="c")]
    assert [r.job for r in report.sort_rows(rows)] == ["b", "a", "c"]


def test_format_text_shows_what_varies(tmp_path):
    make_run(tmp_path, "0", overrides=["model=mlp", "optimizer.lr=0.1"], acc=0.5)
    make_run(tmp_path, "1", overrides=["model=mlp", "optimizer.lr=0.2"], acc=0.7)
    text = report.format_rows(report.collect(tmp_path))
    lines = text.splitlines()
    assert lines[0].split() == ["job", "overrides", "status", "final", "val/acc", "best", "val/acc",
                                "test/acc", "val/loss", "epochs", "steps", "wall", "s", "error"]
    assert lines[1].split() == ["1", "optimizer.lr=0.2", "completed", "0.7000", "0.8000", "0.3000",
                                "2", "8", "3.2"]
    assert lines[0].index("status") == lines[1].index("completed")  # aligned columns
    assert "model=mlp" not in text


def test_format_md_escapes_pipes():
    row = report.Row(job="0", error="a | b", status="failed")
    md = report.format_rows([row], "md")
    assert md.splitlines()[1].startswith("|---|")
    assert "a \\| b" in md


def test_format_csv_and_json(tmp_path):
    make_run(tmp_path, "0", overrides=["a=1", "b=2"], test=0.4)
    rows = report.collect(tmp_path)
    parsed = list(csv.DictReader(io.StringIO(report.format_rows(rows, "csv"))))
    assert parsed[0]["overrides"] == "a=1 b=2" and parsed[0]["val/loss"] == "0.5"
    assert parsed[0]["test/acc"] == "0.4"
    data = json.loads(report.format_rows(rows, "json"))
    assert data[0]["best"] == 0.6 and data[0]["job"] == "0"


def test_unknown_format():
    with pytest.raises(ValueError, match="format 'xml' is not one of text, md, csv, json"):
        report.format_rows([], "xml")


def test_long_error_cut_to_one_line():
    row = report.Row(job="0", error="line\n" + "x" * 200)
    cell = report._cell(row, "error")
    assert len(cell) == 120 and cell.endswith("...") and "\n" not in cell


def test_group_seeds_mean_and_std(tmp_path):
    make_run(tmp_path, "0", overrides=["lr=1", "seed=0"], seed=0, acc=0.4)
    make_run(tmp_path, "1", overrides=["lr=1", "seed=1"], seed=1, acc=0.6)
    make_run(tmp_path, "2", overrides=["lr=2", "seed=0"], seed=0, acc=0.9, status="failed")
    rows = report.collect(tmp_path)
    assert report.varies_seed(rows)
    first, second = report.group_seeds(rows)
    assert (first.overrides, first.n, first.seeds, first.status) == (["lr=2"], 1, [0], "failed 1")
    assert second.overrides == ["lr=1"] and second.seeds == [0, 1] and second.jobs == ["0", "1"]
    mean, std, count = second.stats["final"]
    assert (mean, count) == (pytest.approx(0.5), 2) and std == pytest.approx(0.1414213, rel=1e-5)
    assert first.stats["final"][1] is None
    text = report.format_groups([second])
    assert "0.5000 ± 0.1414" in text


def test_mean_std_cell():
    assert report._mean_std((0.5, None, 1), 1) == "0.5000"
    assert report._mean_std((0.5, 0.25, 2), 3) == "0.5000 ± 0.2500 (2 of 3)"
    assert report._mean_std(None, 2) == ""


def test_write_summary_by_seed_only_when_seeds_vary(tmp_path):
    make_run(tmp_path, "0", overrides=["lr=1"], seed=0)
    make_run(tmp_path, "1", overrides=["lr=2"], seed=0)
    report.write_summary(tmp_path, report.collect(tmp_path))
    assert (tmp_path / "summary.csv").is_file() and (tmp_path / "summary.md").is_file()
    assert not (tmp_path / "summary_by_seed.csv").exists()
    make_run(tmp_path, "2", overrides=["lr=1", "seed=5"], seed=5)
    report.write_summary(tmp_path, report.collect(tmp_path))
    assert "seeds" in (tmp_path / "summary_by_seed.md").read_text()


def test_own_overrides_drop_resume():
    assert report.own_overrides(["resume=auto", "+x=1", "~resume"]) == ["+x=1"]
