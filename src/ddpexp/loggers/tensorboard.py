"""TensorBoard events in the run dir's ``tb/``: scalars on the global step, the resolved config
as YAML text, and the HParams session (hyperparameters at the start, status at the end).

No graph is written, so event files stay small. Each session writes its own event file; a
resumed one purges the steps after its checkpoint, so no step shows twice. An event file that
cannot be written (a full disk) is one warning of the logger's writer naming ``tb/``, not a
traceback of TensorBoard's writer thread on the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import yaml

from ddpexp.errors import ConfigError, naming
from ddpexp.loggers.base import SUCCESS_STATUSES, Logger, RunInfo

log = logging.getLogger("ddpexp")


class _QuietEventWriterThread:
    """``threading.excepthook`` that leaves out TensorBoard's event-file thread: that thread
    keeps the error that stopped it and raises it again at the writer's next call, where the
    logger's writer reports it once; its traceback on the terminal would only repeat it (it
    goes to the log at DEBUG). Every other thread's error is handed on as before."""

    def __init__(self, before: Any) -> None:
        self.before = before

    def __call__(self, args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and \
                isinstance(args.exc_value, Exception):
            log.debug("TensorBoard's event writer thread stopped", exc_info=(
                args.exc_type, args.exc_value, args.exc_traceback))
            return
        self.before(args)


def _quiet_event_writer_thread() -> None:
    """Install :class:`_QuietEventWriterThread` (once per process)."""
    if not isinstance(threading.excepthook, _QuietEventWriterThread):
        threading.excepthook = _QuietEventWriterThread(threading.excepthook)


@contextlib.contextmanager
def _naming(directory: Path | None) -> Iterator[None]:
    """An OSError that names no file (the event file failed as it was flushed) names the
    event files' dir."""
    try:
        yield
    except OSError as exc:
        raise naming(exc, directory or "tb") from None


def _hparam_value(value: Any) -> Any:
    """HParams take bool, int, float or str; everything else is shown as text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class TensorBoardLogger(Logger):
    """``SummaryWriter`` with the run's conventions: the global step on every x-axis, one event
    file per session, ``purge_step`` when resuming."""

    def __init__(self, flush_secs: float = 30, flush_every_s: float = 1.0):
        if isinstance(flush_every_s, bool) or not isinstance(flush_every_s, (int, float)) \
                or flush_every_s < 0:
            raise ConfigError(f"flush_every_s={flush_every_s!r} must be >= 0 "
                              "(seconds between hand-overs)")
        self.flush_secs = flush_secs
        # The writer hands points over (add_scalar each, then one flush of the event file)
        # at most this often: a flush per log step took 0.3-0.7 ms of the loop's interpreter
        # on the writer's thread, on a step of a few ms.
        self.flush_every_s = float(flush_every_s)
        self.writer: Any = None  # a SummaryWriter from open() to finalize()
        self.directory: Path | None = None

    def open(self, run: RunInfo) -> None:
        """Open ``run_dir/tb``; a fresh run also gets its config as text."""
        from torch.utils.tensorboard import SummaryWriter

        # Events of steps after the checkpoint were written by the session that crashed;
        # this session writes them again.
        purge_step = run.step + 1 if run.resumed else None
        self.directory = Path(run.run_dir) / "tb"
        _quiet_event_writer_thread()
        with _naming(self.directory):
            self.writer = SummaryWriter(str(self.directory), purge_step=purge_step,
                                        flush_secs=cast(int, self.flush_secs))  # any number of seconds
            if not run.resumed:
                text = yaml.safe_dump(dict(run.config), sort_keys=False)
                self.writer.add_text("config", "```yaml\n" + text + "```", 0)

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """Open this run's HParams session with the hyperparameters it was given.

        Only the session is written, no per-run experiment summary: TensorBoard then builds
        the HParams table from the sessions of all runs under its logdir (the union of their
        hyperparameters) and offers every scalar tag of the runs as a metric, read as its latest
        value: whatever names the task logs (``val/acc``, ``val/mse``, ``best/val/...``)."""
        from torch.utils.tensorboard.summary import hparams as hp_summary

        clean = {k: _hparam_value(v) for k, v in params.items()}
        _, ssi, _ = hp_summary(clean, {})
        with _naming(self.directory):
            self.writer.file_writer.add_summary(ssi)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """One scalar per tag at the global step."""
        with _naming(self.directory):
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Write the events logged so far to the event file."""
        if self.writer is not None:
            with _naming(self.directory):
                self.writer.flush()

    def finalize(self, status: str) -> None:
        """Close the HParams session with the run's status, then the event file."""
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        with _naming(self.directory):
            try:
                writer.file_writer.add_summary(_session_end(status))
            finally:
                writer.close()


def _session_end(status: str) -> Any:
    """The HParams plugin's session-end summary: success for the statuses that end a run as
    intended, failure for the others."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs
    from tensorboard.plugins.hparams.api_pb2 import Status  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs
    from tensorboard.plugins.hparams.metadata import (
        PLUGIN_DATA_VERSION,
        PLUGIN_NAME,
        SESSION_END_INFO_TAG,
    )
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo  # pyright: ignore[reportAttributeAccessIssue]  # protobuf-generated, no stubs

    state = "STATUS_SUCCESS" if status in SUCCESS_STATUSES else "STATUS_FAILURE"
    content = HParamsPluginData(
        session_end_info=SessionEndInfo(status=Status.Value(state)),
        version=PLUGIN_DATA_VERSION,
    )
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name=PLUGIN_NAME, content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=metadata)])
