"""The writer between the loop and each logger (ddpexp.loggers.writer): the loop never waits,
a full queue drops its oldest points and counts them, a failing logger costs one warning then
at most one a minute, a checkpoint holds the last acknowledged step and the points after it,
the end of a run waits at most flush_timeout_s; and a store that cannot be used is refused by
prepare in seconds, naming the key (a server and training runs: tests/e2e/test_mlflow_runs.py)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from ddpexp.errors import ConfigError
from ddpexp.loggers import Logger, RunInfo, prepare_loggers
from ddpexp.loggers.collection import Loggers
from ddpexp.loggers.mlflow import PREPARE_ENV
from ddpexp.loggers.writer import WARN_EVERY_S, Writer


class Recording(Logger):
    """A user's logger that records every call and the thread it came from; ``gate`` (when
    set) holds ``flush`` until it is opened, ``fail`` makes ``flush`` raise."""

    def __init__(self) -> None:
        self.calls: list = []
        self.threads: set = set()
        self.stored: list = []
        self.pending: list = []
        self.gate: threading.Event | None = None
        self.fail = False

    def _record(self, *call) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(call)

    def load_state_dict(self, state):
        self._record("load_state_dict", state)

    def open(self, run):
        self._record("open", run.resumed, run.step)

    def log_hparams(self, params):
        self._record("log_hparams", dict(params))

    def log_metrics(self, metrics, step, epoch):
        self._record("log_metrics", step)
        self.pending += [(step, k) for k in metrics]

    def flush(self):
        self._record("flush")
        if self.gate is not None:
            self.gate.wait(30)
        pending, self.pending = self.pending, []
        if self.fail:
            raise ConnectionError("the tracker is gone")
        self.stored += pending

    def state_dict(self):
        self._record("state_dict")
        return {"stored": len(self.stored)}

    def finalize(self, status):
        self._record("finalize", status)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(tmp_path: Path, resumed: bool = False, step: int = 0) -> RunInfo:
    return RunInfo(tmp_path, "run", {}, {"lr": 0.1}, resumed, step)


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the writer never got there"
        time.sleep(0.005)


def _finish(writer: Writer, status: str = "completed") -> None:
    writer.end(status)
    writer.wait(time.monotonic())


def test_every_call_comes_from_one_thread_in_order_and_points_once(tmp_path):
    logger = Recording()
    loggers = Loggers({"mine": logger})
    loggers.open(_run(tmp_path))
    for step in range(1, 6):
        loggers.log_metrics({"train/loss": 1 / step, "lr": 0.1}, step, 0)
    loggers.finalize("completed")
    assert logger.threads and threading.get_ident() not in logger.threads
    assert len(logger.threads) == 1
    assert logger.calls[:3] == [("open", False, 0), ("log_hparams", {"lr": 0.1}), ("state_dict",)]
    assert logger.calls[-1] == ("finalize", "completed")
    assert [c[1] for c in logger.calls if c[0] == "log_metrics"] == [1, 2, 3, 4, 5]
    assert sorted(logger.stored) == sorted((s, k) for s in range(1, 6) for k in ("train/loss", "lr"))
    assert loggers.lost() == {}


def test_no_thread_without_loggers():
    before = threading.active_count()
    empty = Loggers({})
    empty.open(None)
    empty.log_metrics({"a": 1.0}, 1, 0)
    empty.finalize("completed")
    assert threading.active_count() == before and empty.lost() == {}


def test_a_stuck_logger_never_holds_up_the_loop_and_a_full_queue_drops_the_oldest(tmp_path, caplog):
    logger = Recording()
    logger.gate = threading.Event()
    logger.flush_timeout_s = 0.3
    writer = Writer("stuck", logger, capacity=100)
    writer.start(_run(tmp_path))
    writer.put({"a": 1.0}, 1, 0)
    writer.put({"a": 1.0}, 2, 0)  # step 1 is ready now: the logger's flush blocks on the gate
    _until(lambda: ("flush",) in logger.calls)
    took = []
    with caplog.at_level(logging.DEBUG, "ddpexp"):
        for step in range(3, 303):  # 10 points a call: 3,000 points into a queue of 100
            started = time.perf_counter()
            writer.put({f"m{i}": float(i) for i in range(10)}, step, 0)
            took.append(time.perf_counter() - started)
    assert max(took) < 0.05, max(took)
    lost = writer.lost.as_dict()
    # Step 2's point and the 10-point calls of steps 3..292 were dropped; 293..302 are queued.
    assert lost == {"points": 1 + 290 * 10, "steps": [[2, 292]]}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "logger.stuck lost points from step 2 on" in warnings[0].getMessage()
    assert "queue is full (100 points)" in warnings[0].getMessage()
    # The end of the run waits flush_timeout_s, then counts what was still queued.
    started = time.monotonic()
    _finish(writer)
    assert time.monotonic() - started < 1.0
    assert writer.lost.as_dict() == {"points": 2 + 300 * 10, "steps": [[1, 302]]}
    assert not any(c[0] == "finalize" for c in logger.calls)
    logger.gate.set()


def test_a_failing_logger_warns_once_then_at_most_once_a_minute(tmp_path, caplog):
    clock = Clock()
    logger = Recording()
    writer = Writer("tracker", logger, clock=clock)
    writer.start(_run(tmp_path))
    writer.put({"a": 1.0}, 1, 0)
    writer.put({"a": 1.0}, 2, 0)
    _until(lambda: writer.snapshot()[1]["acked_step"] == 1)
    logger.fail = True
    with caplog.at_level(logging.DEBUG, "ddpexp"):
        for step in range(3, 8):
            writer.put({"a": 1.0, "b": 2.0}, step, 0)
            _until(lambda want=1 + 2 * (step - 3): writer.lost.points >= want)
            clock.now += 10  # 40 s in all: within the minute
        clock.now += WARN_EVERY_S
        writer.put({"a": 1.0}, 8, 0)
        _until(lambda: writer.lost.points == 11)
        logger.fail = False
        writer.put({"a": 1.0}, 9, 0)
        _until(lambda: writer.snapshot()[1]["acked_step"] == 8)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "logger.tracker lost points from step 2 on" in warnings[0]
    assert "ConnectionError: the tracker is gone" in warnings[0]
    assert "the run trains on" in warnings[0]
    assert "has lost 11 point(s) so far, steps 2-7 (latest: step 7)" in warnings[1]
    _finish(writer)
    assert writer.lost.as_dict() == {"points": 11, "steps": [[2, 7]]}
    assert logger.calls[-1] == ("finalize", "completed")


def test_a_checkpoint_holds_the_acknowledged_step_and_a_resume_sends_the_rest_once(tmp_path):
    logger = Recording()
    logger.gate = threading.Event()
    writer = Writer("mine", logger)
    writer.start(_run(tmp_path))
    writer.put({"a": 1.0}, 1, 0)
    writer.put({"a": 2.0}, 2, 0)
    _until(lambda: ("flush",) in logger.calls)  # step 1 in flight
    writer.put({"b": 2.0}, 2, 0)
    writer.put({"a": 3.0}, 3, 0)
    state, queue = writer.snapshot()
    # Nothing acknowledged yet: step 1 is in flight, 2 waits, 3 (the newest) is held back.
    assert queue["acked_step"] is None and state == {"stored": 0}
    assert [p[0] for p in queue["pending"]] == [1, 2, 2, 3]
    logger.gate.set()
    _until(lambda: writer.snapshot()[1]["acked_step"] == 2)
    state, queue = writer.snapshot()
    assert state == {"stored": 3} and queue["pending"] == [[3, 0, {"a": 3.0}]]
    assert queue["lost"] == {"points": 0, "steps": []}

    # A resumed session from that checkpoint: the logger is told step 2 is stored, step 3
    # comes from the queue, 4 from the loop.
    again = Recording()
    resumed = Writer("mine", again)
    resumed.load(state, queue)
    resumed.start(_run(tmp_path, resumed=True, step=3))
    resumed.put({"a": 4.0}, 4, 0)
    _finish(resumed)
    assert again.calls[:2] == [("load_state_dict", {"stored": 3}), ("open", True, 2)]
    assert again.stored == [(3, "a"), (4, "a")]
    _finish(writer)


def test_an_old_checkpoint_without_queues_resumes_at_its_step(tmp_path):
    logger = Recording()
    loggers = Loggers({"mine": logger, "new": Recording()})
    loggers.load_state_dict({"loggers": {"mine": {"stored": 5}}})
    loggers.open(_run(tmp_path, resumed=True, step=6))
    loggers.finalize("completed")
    assert logger.calls[:2] == [("load_state_dict", {"stored": 5}), ("open", True, 6)]
    assert loggers["new"].calls[0] == ("open", True, 6)


def test_a_logger_that_cannot_open_loses_its_points_not_the_run(tmp_path, caplog):
    class Broken(Recording):
        def open(self, run):
            raise OSError("no such server")

    loggers = Loggers({"broken": Broken()})
    with caplog.at_level(logging.WARNING, "ddpexp"):
        loggers.open(_run(tmp_path))
        for step in (1, 2, 3):
            loggers.log_metrics({"a": 1.0}, step, 0)
        loggers.finalize("completed")
    assert loggers.lost() == {"broken": {"points": 3, "steps": [[1, 3]]}}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "logger.broken could not open (OSError: no such server)" in warning


# ------------------------------------------------------------------ stores refused by prepare
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_only_dir(tmp_path: Path) -> Path:
    """A dir no file can be created in: chmod 555 for a user; for root, whom modes do not
    stop, sysfs."""
    if os.geteuid() == 0:
        return Path("/sys")
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    return path


@pytest.mark.parametrize("case", ["closed port", "missing dir", "under a file", "read-only"])
def test_a_store_that_cannot_be_used_is_one_message_in_seconds(tmp_path, case, caplog):
    pytest.importorskip("mlflow")
    (tmp_path / "afile").write_text("x")
    uri, named = {
        "closed port": (f"http://127.0.0.1:{_closed_port()}", "the tracking server does not answer"),
        "missing dir": (f"sqlite:///{tmp_path}/nope/mlflow.db", f"the directory {tmp_path}/nope does not exist"),
        "under a file": (f"sqlite:///{tmp_path}/afile/db/mlflow.db", f"under {tmp_path}/afile, which is a file"),
        "read-only": (f"sqlite:///{_read_only_dir(tmp_path)}/mlflow.db", "cannot write in"),
    }[case]
    env_before = {k: os.environ.get(k) for k in PREPARE_ENV}
    node = {"_target_": "ddpexp.loggers.MLflowLogger", "tracking_uri": uri}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        prepare_loggers({"tracker": node}, tmp_path)
    assert time.monotonic() - started < 30
    assert str(err.value).startswith(f"logger.tracker.tracking_uri={uri}: ")
    assert named in str(err.value)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no retry messages
    assert {k: os.environ.get(k) for k in PREPARE_ENV} == env_before
