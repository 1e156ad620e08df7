"""ddpexp.report on real run dirs written the way the trainer writes them."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpexp import report


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


def test_min_mode_sorts_ascending(tmp_path: Path) -> None:
    fake_run(tmp_path / "0", ["lr=1"], metrics(0.3, 0.3, "min", "val/loss"))
    fake_run(tmp_path / "1", ["lr=2"], metrics(0.1, 0.2, "min", "val/loss"))
    assert [r.job for r in report.collect(tmp_path)] == ["1", "0"]


def test_format_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="not one of text, md, csv, json"):
        report.format_rows([], "html")


def test_cli_prints_the_table(tmp_path: Path) -> None:
    fake_run(tmp_path / "sweep" / "0", ["lr=0.1"], metrics(0.5, 0.4))
    out = subprocess.run([sys.executable, "-m", "ddpexp.report", str(tmp_path), "-f", "md"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| sweep/0 | lr=0.1 | completed | 0.4000 | 0.5000 |" in out
    bad = subprocess.run([sys.executable, "-m", "ddpexp.report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "is not a directory" in bad.stderr
