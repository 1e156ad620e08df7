"""TensorBoard events in the run dir's ``tb/``: scalars on the global step, the resolved config
as YAML text, and the HParams session (hyperparameters at the start, status at the end).

No graph is written, so event files stay small. Each session writes its own event file; a
resumed one purges the steps after its checkpoint, so no step shows twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import yaml

from ddpexp.loggers.base import SUCCESS_STATUSES, Logger, RunInfo


def _hparam_value(value: Any) -> Any:
    """HParams take bool, int, float or str; everything else is shown as text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class TensorBoardLogger(Logger):
    """``SummaryWriter`` with the run's conventions: the global step on every x-axis, one event
    file per session, ``purge_step`` when resuming."""

    def __init__(self, flush_secs: float = 30):
        self.flush_secs = flush_secs
        self.writer: Any = None  # a SummaryWriter from open() to finalize()

    def open(self, run: RunInfo) -> None:
        """Open ``run_dir/tb``; a fresh run also gets its config as text."""
        from torch.utils.tensorboard import SummaryWriter

        # Events of steps after the checkpoint were written by the session that crashed;
        # this session writes them again.
        purge_step = run.step + 1 if run.resumed else None
        self.writer = SummaryWriter(str(run.run_dir / "tb"), purge_step=purge_step,
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
        self.writer.file_writer.add_summary(ssi)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        """One scalar per tag at the global step."""
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Write the events logged so far to the event file."""
        if self.writer is not None:
            self.writer.flush()

    def finalize(self, status: str) -> None:
        """Close the HParams session with the run's status, then the event file."""
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
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
