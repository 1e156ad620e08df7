"""TensorBoard events (loggers/tensorboard.py), read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest

from ddpexp.loggers.base import RunInfo
from ddpexp.loggers.tensorboard import TensorBoardLogger, _hparam_value, _session_end


def read(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def session(run_dir, resumed=False, step=0, metrics=(), status="completed"):
    log = TensorBoardLogger(flush_secs=1)
    log.open(RunInfo(run_dir=run_dir, name="r", config={"seed": 3, "model": {"hidden": [8]}},
                     hparams={"optimizer.lr": 0.1}, resumed=resumed, step=step))
    if not resumed:
        log.log_hparams({"optimizer.lr": 0.1, "model.hidden": [8]})
    for s, values in metrics:
        log.log_metrics(values, step=s, epoch=0)
    log.finalize(status)
    return log


def test_scalars_on_global_step_and_config_text(tmp_path):
    session(tmp_path, metrics=[(1, {"train/loss": 2.0}), (2, {"train/loss": 1.5, "val/acc": 0.5})])
    acc = read(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.5)]
    assert [(e.step, e.value) for e in acc.Scalars("val/acc")] == [(2, 0.5)]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "seed: 3" in text and text.startswith("```yaml")


def test_hparams_session_written(tmp_path):
    session(tmp_path, metrics=[(1, {"val/acc": 0.1})])
    acc = read(tmp_path / "tb")
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = acc.PluginTagToContent("hparams")
    assert set(content) == {"_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["optimizer.lr"].number_value == 0.1
    assert start.hparams["model.hidden"].string_value == "[8]"


PREFIX = "events.out.tfevents."


def started_earlier(tb_dir, seconds=10):
    """Date the event files in ``tb_dir`` back by ``seconds``, as a run resumed later would
    find them. TensorBoard reads a dir's files in the order of their names (time, host, pid,
    then a per-process counter, compared as text): two sessions of one process in one second
    would otherwise be read in either order, as the counter passes 9 or 99."""
    for path in tb_dir.glob(PREFIX + "*"):
        stamp, rest = path.name.removeprefix(PREFIX).split(".", 1)
        path.rename(path.with_name(f"{PREFIX}{int(stamp) - seconds:010d}.{rest}"))


def test_resume_purges_later_steps(tmp_path):
    session(tmp_path, metrics=[(s, {"train/loss": float(s)}) for s in (1, 2, 3, 4)], status="failed")
    started_earlier(tmp_path / "tb")
    session(tmp_path, resumed=True, step=2, metrics=[(3, {"train/loss": 30.0})])
    acc = read(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_finalize_without_open_is_noop():
    TensorBoardLogger().finalize("completed")


def test_hparam_values():
    assert _hparam_value(3) == 3 and _hparam_value("x") == "x" and _hparam_value(True) is True
    assert _hparam_value([8, 8]) == "[8, 8]" and _hparam_value(None) == "None"


@pytest.mark.parametrize("status, expected", [("completed", 1), ("early_stopped", 1), ("stopped", 1),
                                              ("failed", 2), ("diverged", 2), ("pruned", 2)])
def test_session_end_status(status, expected):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    summary = _session_end(status)
    data = HParamsPluginData.FromString(summary.value[0].metadata.plugin_data.content)
    assert data.session_end_info.status == expected  # STATUS_SUCCESS = 1, STATUS_FAILURE = 2


def test_a_failed_event_writer_thread_is_kept_off_the_terminal(tmp_path):
    """TensorBoard's event-file thread that meets a full disk (``/dev/full``) keeps its error
    for the writer's next call; the excepthook a logger installs leaves its traceback off the
    terminal, and hands every other thread's error on as before."""
    import queue
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    from tensorboard.summary.writer.record_writer import RecordWriter

    from ddpexp.loggers.tensorboard import _QuietEventWriterThread

    seen = []
    before = threading.excepthook
    threading.excepthook = _QuietEventWriterThread(seen.append)
    try:
        events = queue.Queue()
        events.put(b"event")
        with open("/dev/full", "wb") as full:
            thread = _AsyncWriterThread(events, RecordWriter(full), flush_secs=0)
            thread.start()
            thread.join(10)
            other = threading.Thread(target=lambda: 1 / 0)
            other.start()
            other.join(10)
            full.raw.close()  # what was buffered for /dev/full is dropped, not flushed
    finally:
        threading.excepthook = before
    assert isinstance(thread.exception, OSError)  # raised again at the writer's next call
    assert [a.exc_type for a in seen] == [ZeroDivisionError]


def test_points_reach_the_event_file_together_at_flush_every_s(tmp_path):
    """The writer holds a log step's points until ``flush_every_s`` after the last hand-over
    (one add_scalar each, then one flush for all); the run's end writes every one."""
    import time

    from ddpexp.loggers.collection import Loggers

    loggers = Loggers({"tensorboard": TensorBoardLogger(flush_every_s=30)})
    loggers.open(RunInfo(run_dir=tmp_path, name="r", config={}, hparams={}, resumed=False, step=0))
    for step in range(1, 6):
        loggers.log_metrics({"train/loss": 1.0 / step}, step, 0)
    time.sleep(0.5)
    assert "train/loss" not in read(tmp_path / "tb").Tags()["scalars"]
    loggers.finalize("completed")
    assert [e.step for e in read(tmp_path / "tb").Scalars("train/loss")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [-1, "soon", True])
def test_a_bad_flush_every_s_is_refused(bad):
    from ddpexp.errors import ConfigError

    with pytest.raises(ConfigError, match="flush_every_s"):
        TensorBoardLogger(flush_every_s=bad)
