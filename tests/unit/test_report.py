"""ddpexp.report on real run dirs written the way the trainer writes them."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from ddpexp import report
from ddpexp.record import write_metrics


def fake_run(d: Path, overrides: list[str], metrics: dict | None) -> Path:
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text("{}\n")
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if metrics is not None:
        (d / "metrics.json").write_text(json.dumps(metrics))
    return d


def metrics(best: float, final: float, mode: str = "max", monitor: str = "val/acc") -> dict:
    return {"status": "completed", "epochs": 2, "steps": 10, "monitor": monitor,
            "monitor_mode": mode, "final": {monitor: final}, "best": {monitor: best, "epoch": 1},
            "wall_time_s": 1.5}


def test_collect_sorts_best_first_and_keeps_runs_without_metrics(tmp_path: Path) -> None:
    fake_run(tmp_path / "0", ["lr=0.1", "bs=8"], metrics(0.5, 0.4))
    fake_run(tmp_path / "1", ["lr=0.2", "bs=8"], metrics(0.9, 0.8))
    fake_run(tmp_path / "2", ["lr=0.3", "bs=8"], None)
    fake_run(tmp_path / "10", ["lr=0.4", "bs=8"], metrics(0.7, 0.7))
    rows = report.collect(tmp_path)
    assert [r.job for r in rows] == ["1", "10", "0", "2"]
    assert rows[-1].status == report.NO_METRICS and rows[-1].best is None
    text = report.format_rows(rows, "text")
    # The table shows what varies between runs; bs=8 is common to all.
    assert "lr=0.2" in text and "bs=8" not in text and "best val/acc" in text
    parsed = list(csv.DictReader(io.StringIO(report.format_rows(rows, "csv"))))
    assert parsed[0]["overrides"] == "lr=0.2 bs=8" and float(parsed[0]["best"]) == 0.9
    assert json.loads(report.format_rows(rows, "json"))[1]["job"] == "10"
    md = report.format_rows(rows, "md").splitlines()
    assert len(md) == 2 + 4 and md[2].startswith("| 1 | lr=0.2 | completed | 0.8000 | 0.9000 |")


def test_a_resumed_job_shows_its_own_overrides_and_both_times(tmp_path: Path) -> None:
    # A job first run by a resumed sweep has the resume=auto the sweep was given.
    fake_run(tmp_path / "0", ["lr=0.1"], {**metrics(0.5, 0.4), "train_time_s": 0.3})
    fake_run(tmp_path / "1", ["lr=0.2", "resume=auto"], metrics(0.6, 0.6))
    rows = {r.job: r for r in report.collect(tmp_path)}
    assert rows["0"].overrides == ["lr=0.1"] and rows["1"].overrides == ["lr=0.2"]
    assert (rows["0"].wall_time_s, rows["0"].train_time_s) == (1.5, 0.3)
    assert "resume" not in report.format_rows(list(rows.values()), "text")
    assert report.own_overrides(["+resume=x", "seed=1", "~resume"]) == ["seed=1"]


def test_min_mode_sorts_ascending(tmp_path: Path) -> None:
    fake_run(tmp_path / "0", ["lr=1"], metrics(0.3, 0.3, "min", "val/loss"))
    fake_run(tmp_path / "1", ["lr=2"], metrics(0.1, 0.2, "min", "val/loss"))
    assert [r.job for r in report.collect(tmp_path)] == ["1", "0"]


def test_format_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="not one of text, md, csv, json"):
        report.format_rows([], "html")


def test_cli_prints_the_table(tmp_path: Path, capsys) -> None:
    fake_run(tmp_path / "sweep" / "0", ["lr=0.1"], metrics(0.5, 0.4))
    assert report.main([str(tmp_path), "-f", "md"]) == 0
    assert "| sweep/0 | lr=0.1 | completed | 0.4000 | 0.5000 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        report.main([str(tmp_path / "nope")])
    assert bad.value.code != 0 and "is not a directory" in capsys.readouterr().err


# ------------------------------------------------------------------ test column and seeds
def seeded_run(d: Path, overrides: list[str], seed: int, best: float, final: float,
               test: float | None, curve: list[float] | None = None) -> Path:
    """A run dir as the trainer leaves it: config with its seed, metrics.json with a "test"
    entry, and (``curve``) TensorBoard val/acc points at steps 10, 20, ..."""
    m = metrics(best, final)
    if test is not None:
        m["test"] = {"test/acc": test, "test/loss": 1.0 - test, "epoch": 1}
    fake_run(d, [*overrides, f"seed={seed}"], m)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "trainer": {}}))
    if curve:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(d / "tb")) as w:
            for i, v in enumerate(curve):
                w.add_scalar("val/acc", v, 10 * (i + 1))
    return d


def test_test_column_beside_best(tmp_path: Path) -> None:
    seeded_run(tmp_path / "0", ["lr=0.1"], 0, best=0.9, final=0.8, test=0.85)
    seeded_run(tmp_path / "1", ["lr=0.2"], 0, best=0.7, final=0.7, test=None)
    rows = report.collect(tmp_path)
    assert [(r.best, r.test) for r in rows] == [(0.9, 0.85), (0.7, None)]
    text = report.format_rows(rows, "text").splitlines()
    titles = text[0].split()
    assert titles[titles.index("val/acc", titles.index("best")) + 1] == "test/acc"
    assert re.search(r"0\.9000 +0\.8500 +0\.1500", text[1])  # best, test/acc, test/loss
    parsed = list(csv.DictReader(io.StringIO(report.format_rows(rows, "csv"))))
    assert float(parsed[0]["test"]) == 0.85 and float(parsed[0]["test/loss"]) == pytest.approx(0.15)
    assert parsed[1]["test"] == "" and parsed[0]["seed"] == "0"


def test_group_seeds_mean_and_std(tmp_path: Path) -> None:
    # lr=0.1: best 0.5, 0.6, 0.7 (mean 0.6, sample std 0.1); lr=0.2: one seed failed.
    for job, (lr, seed, best, test) in enumerate([
        (0.1, 0, 0.5, 0.40), (0.1, 1, 0.6, 0.50), (0.1, 2, 0.7, 0.60),
        (0.2, 0, 0.9, 0.80), (0.2, 1, 0.8, 0.70),
    ]):
        seeded_run(tmp_path / str(job), [f"lr={lr}", "bs=8"], seed, best, best - 0.1, test)
    fake_run(tmp_path / "5", ["lr=0.2", "bs=8", "seed=2"], {"status": "failed", "error": "boom"})
    groups = report.group_seeds(report.collect(tmp_path))
    assert [(g.overrides, g.n, g.seeds) for g in groups] == [
        (["lr=0.2", "bs=8"], 3, [0, 1, "?"]), (["lr=0.1", "bs=8"], 3, [0, 1, 2])]
    low = groups[1]
    for name, mean in (("best", 0.6), ("final", 0.5), ("test", 0.5), ("test/loss", 0.5)):
        assert low.stats[name][0] == pytest.approx(mean) and low.stats[name][1] == pytest.approx(0.1)
        assert low.stats[name][2] == 3
    high = groups[0]
    assert high.stats["best"] == (pytest.approx(0.85), pytest.approx(0.0707107, abs=1e-6), 2)
    assert high.status == "completed 2, failed 1"
    text = report.format_groups(groups, "text")
    assert "0.8500 ± 0.0707 (2 of 3)" in text and "0.6000 ± 0.1000" in text
    assert "bs=8" not in text and "seed=" not in text
    rows = list(csv.DictReader(io.StringIO(report.format_groups(groups, "csv"))))
    assert rows[1]["n"] == "3" and float(rows[1]["best_std"]) == pytest.approx(0.1)
    assert rows[1]["seeds"] == "0 1 2" and rows[1]["jobs"] == "0 1 2"


def test_summary_by_seed_only_where_seeds_vary(tmp_path: Path) -> None:
    for job, lr in enumerate((0.1, 0.2)):
        seeded_run(tmp_path / "a" / str(job), [f"lr={lr}"], 0, 0.5 + lr, 0.5, 0.5)
    report.write_summary(tmp_path / "a", report.collect(tmp_path / "a"))
    assert (tmp_path / "a" / "summary.md").is_file()
    assert not (tmp_path / "a" / "summary_by_seed.md").exists()
    for job, seed in enumerate((0, 1)):
        seeded_run(tmp_path / "b" / str(job), ["lr=0.1"], seed, 0.5 + seed / 10, 0.5, 0.5)
    report.write_summary(tmp_path / "b", report.collect(tmp_path / "b"))
    md = (tmp_path / "b" / "summary_by_seed.md").read_text().splitlines()
    assert md[0].startswith("| overrides | n | seeds | status | final val/acc | best val/acc | test/acc")
    assert md[2].startswith("| lr=0.1 | 2 | 0 1 | completed 2 | 0.5000 ± 0.0000 | 0.5500 ± 0.0707 |")
    assert (tmp_path / "b" / "summary_by_seed.csv").read_text().startswith("overrides,n,seeds")


def test_cli_group_seeds_plots_mean_and_band(tmp_path: Path) -> None:
    from ddpexp.plot import mean_curve

    for job, (lr, seed, curve) in enumerate([
        ("0.1", 0, [0.2, 0.4]), ("0.1", 1, [0.4, 0.6]), ("0.2", 0, [0.5, 0.9]), ("0.2", 1, [0.5, 0.7]),
    ]):
        seeded_run(tmp_path / str(job), [f"lr={lr}"], seed, max(curve), curve[-1], 0.5, curve)
    assert mean_curve([tmp_path / "0", tmp_path / "1"], "val/acc") == [
        (10, pytest.approx(0.3), pytest.approx(0.1414214, abs=1e-6), 2),
        (20, pytest.approx(0.5), pytest.approx(0.1414214, abs=1e-6), 2)]
    png = tmp_path / "curves.png"
    assert report.main([str(tmp_path), "--group-seeds", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_a_job_refused_before_it_trained_shows_the_error_its_sweep_recorded(tmp_path: Path, capsys) -> None:
    fake_run(tmp_path / "0", ["lr=0.1"], metrics(0.5, 0.4))
    fake_run(tmp_path / "1", ["lr=-1"], None)  # refused before training: no metrics.json
    rows = report.collect(tmp_path)
    rows[1].status, rows[1].error = "failed", "optimizer.lr=-1 must be >= 0 (the learning rate)"
    report.write_summary(tmp_path, rows)  # as the launcher wrote it, from the job's report
    refused = {r.job: r for r in report.collect(tmp_path)}["1"]
    assert refused.status == "failed" and refused.error.startswith("optimizer.lr=-1 must be >= 0")
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "optimizer.lr=-1 must be >= 0" in out and report.NO_METRICS not in out


# ------------------------------------------------------------------ rows, cells and formats
def make_run(root, name, *, overrides=(), seed=0, status="completed", acc=0.5, mode="max",
             test=None, extra=None):
    """A run dir whose metrics.json is written by ddpexp.record, as the trainer writes it."""
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


def test_long_error_cut_to_one_line():
    row = report.Row(job="0", error="line\n" + "x" * 200)
    cell = report.rows._cell(row, "error")
    assert len(cell) == 120 and cell.endswith("...") and "\n" not in cell


def test_a_group_of_one_has_no_std(tmp_path):
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
    assert report.seeds._mean_std((0.5, None, 1), 1) == "0.5000"
    assert report.seeds._mean_std((0.5, 0.25, 2), 3) == "0.5000 ± 0.2500 (2 of 3)"
    assert report.seeds._mean_std(None, 2) == ""


def test_a_run_dir_is_read_again_only_once_its_files_changed(tmp_path: Path, monkeypatch) -> None:
    run = fake_run(tmp_path / "0", ["lr=0.1"], {**metrics(0.5, 0.4), "status": "running"})
    parsed = []
    read = report.rows._read_run
    monkeypatch.setattr(report.rows, "_read_run", lambda d: parsed.append(d) or read(d))
    first = report.read_run(run)
    first.status, first.overrides[0] = "edited by a caller", "lr=9"  # callers change rows
    again = report.read_run(run, job="7")
    assert (again.status, again.overrides, again.job) == ("running", ["lr=0.1"], "7")
    assert len(parsed) == 1
    write_metrics(run, metrics(0.9, 0.8))  # as the trainer writes it: a new file renamed over
    assert (report.read_run(run).status, report.read_run(run).best) == ("completed", 0.9)
    assert len(parsed) == 2
