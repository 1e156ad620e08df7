"""The run record, metrics.json (record.py)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from ddpexp import record
from ddpexp.errors import RunInterrupted


def test_write_read_round_trip_with_nonfinite_and_tensors(tmp_path):
    record.write_metrics(tmp_path, {"status": "completed", "loss": math.nan,
                                    "nested": [math.inf, {"t": torch.tensor(2.5)}], "n": 3})
    text = (tmp_path / "metrics.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert record.read_metrics(tmp_path) == {"status": "completed", "loss": None,
                                             "nested": [None, {"t": 2.5}], "n": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_read_missing_and_unreadable(tmp_path):
    with pytest.raises(FileNotFoundError):
        record.read_metrics(tmp_path)
    assert record.read_metrics_or_empty(tmp_path) == {}
    (tmp_path / "metrics.json").write_text("{cut")
    with pytest.raises(record.UnreadableRecord, match="metrics.json: Expecting property name"):
        record.read_metrics(tmp_path)
    (tmp_path / "metrics.json").write_text("[1, 2]")
    with pytest.raises(record.UnreadableRecord, match="holds a JSON list, not a run's metrics object"):
        record.read_metrics(tmp_path)
    assert record.read_metrics_or_empty(tmp_path) == {}


def test_run_started(monkeypatch):
    monkeypatch.setenv(record.JOB_STARTED_ENV, "123.5")
    assert record.run_started() == 123.5
    monkeypatch.setenv(record.JOB_STARTED_ENV, "soon")
    assert abs(record.run_started() - time.time()) < 5


def test_record_wall_time(tmp_path):
    result = {"status": "completed"}
    record.record_wall_time(tmp_path, result, time.time() - 2)
    saved = record.read_metrics(tmp_path)
    assert saved["status"] == "completed" and 2 <= saved["wall_time_s"] < 60


def test_record_failure_marks_running_attempt(tmp_path):
    record.write_metrics(tmp_path, {"status": "running", "steps": 4})
    record.record_failure(tmp_path, RuntimeError("boom"), time.time())
    saved = record.read_metrics(tmp_path)
    assert (saved["status"], saved["error"], saved["steps"]) == ("failed", "boom", 4)


def test_record_failure_interrupted_without_record(tmp_path):
    record.record_failure(tmp_path, RunInterrupted("stopped", signal="SIGINT"), time.time())
    assert record.read_metrics(tmp_path)["status"] == "interrupted"


def test_record_failure_keeps_finished_record(tmp_path):
    record.write_metrics(tmp_path, {"status": "completed"})
    record.record_failure(tmp_path, RuntimeError("bad resume"), time.time())
    assert record.read_metrics(tmp_path) == {"status": "completed"}


def test_record_failure_on_unwritable_dir_is_let_be(tmp_path):
    record.record_failure(tmp_path / "gone", RuntimeError("x"), time.time())


def test_finished_statuses():
    assert record.FINISHED == ("completed", "early_stopped", "stopped")
    assert json.loads(json.dumps(record._finite((1.0, -math.inf)))) == [1.0, None]
