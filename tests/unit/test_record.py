"""The run record (metrics.json) as ddpexp.record writes and reads it: strict JSON, whole files
only, an attempt's failure marked without erasing an earlier attempt's result, and a wall time
that counts from when the launcher started the job."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from ddpexp import record
from ddpexp.errors import RunFailed, RunInterrupted


def test_a_record_is_strict_json_and_reads_back(tmp_path: Path) -> None:
    record.write_metrics(tmp_path, {"status": "diverged", "final": {"val/loss": float("nan")},
                                    "best": {"val/acc": torch.tensor(0.5), "epoch": 0},
                                    "history": [{"val/loss": float("inf")}]})
    text = (tmp_path / record.METRICS_FILE).read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert record.read_metrics(tmp_path) == {"status": "diverged", "final": {"val/loss": None},
                                             "best": {"val/acc": 0.5, "epoch": 0},
                                             "history": [{"val/loss": None}]}
    assert [p.name for p in tmp_path.iterdir()] == [record.METRICS_FILE]  # no temporary left


def test_what_is_no_record_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        record.read_metrics(tmp_path)
    assert record.read_metrics_or_empty(tmp_path) == {}
    (tmp_path / record.METRICS_FILE).write_text('{"status": "runn')  # cut off
    with pytest.raises(record.UnreadableRecord, match=f"{tmp_path}/metrics.json: "):
        record.read_metrics(tmp_path)
    (tmp_path / record.METRICS_FILE).write_text("[1]")
    with pytest.raises(record.UnreadableRecord, match="holds a JSON list, not a run's metrics"):
        record.read_metrics(tmp_path)
    assert record.read_metrics_or_empty(tmp_path) == {}


def test_a_failure_marks_this_attempt_only(tmp_path: Path) -> None:
    started = time.time() - 2.0
    record.write_metrics(tmp_path, {"status": "running", "epochs": 1})
    record.record_failure(tmp_path, RunInterrupted("stopped by SIGTERM", signal="SIGTERM"), started)
    data = record.read_metrics(tmp_path)
    assert (data["status"], data["error"], data["epochs"]) == ("interrupted", "stopped by SIGTERM", 1)
    assert 2.0 <= data["wall_time_s"] < 60
    # An earlier attempt that ended stays as it ended (a resume that failed before training).
    record.write_metrics(tmp_path, {"status": "completed"})
    record.record_failure(tmp_path, RunFailed("bad resume"), started)
    assert record.read_metrics(tmp_path) == {"status": "completed"}
    record.record_failure(tmp_path / "fresh", RunFailed("x"), started)  # no dir: let be
    (tmp_path / record.METRICS_FILE).unlink()
    record.record_failure(tmp_path, RunFailed("before training"), started)
    assert record.read_metrics(tmp_path)["status"] == "failed"


def test_the_wall_time_counts_from_the_launchers_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(record.JOB_STARTED_ENV, repr(time.time() - 5.0))
    result = {"status": "completed", "train_time_s": 0.3}
    record.record_wall_time(tmp_path, result, record.run_started())
    assert 5.0 <= record.read_metrics(tmp_path)["wall_time_s"] < 60 and result["wall_time_s"] >= 5.0
    monkeypatch.delenv(record.JOB_STARTED_ENV)
    assert abs(record.run_started() - time.time()) < 1.0


def test_a_start_time_that_is_no_number_counts_from_now(monkeypatch) -> None:
    monkeypatch.setenv(record.JOB_STARTED_ENV, "123.5")
    assert record.run_started() == 123.5
    monkeypatch.setenv(record.JOB_STARTED_ENV, "soon")
    assert abs(record.run_started() - time.time()) < 5


def test_any_exception_is_a_failure_and_an_interrupt_needs_no_record(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    record.write_metrics(tmp_path / "a", {"status": "running", "steps": 4})
    record.record_failure(tmp_path / "a", RuntimeError("boom"), time.time())
    saved = record.read_metrics(tmp_path / "a")
    assert (saved["status"], saved["error"], saved["steps"]) == ("failed", "boom", 4)
    (tmp_path / "b").mkdir()
    record.record_failure(tmp_path / "b", RunInterrupted("stopped", signal="SIGINT"), time.time())
    assert record.read_metrics(tmp_path / "b")["status"] == "interrupted"


def test_finished_statuses() -> None:
    assert record.FINISHED == ("completed", "early_stopped", "stopped")
    assert json.loads(json.dumps(record._finite((1.0, -math.inf)))) == [1.0, None]
