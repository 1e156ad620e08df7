"""TensorBoard output of a run: scalars, the resolved config as text, and HParams data.

Only global rank 0 builds a :class:`TBLogger`; every other rank gets ``None`` and writes
nothing. No graph is written, so event files stay small.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import yaml


def _hparam_value(value: Any) -> Any:
    """HParams take bool, int, float or str; everything else is shown as text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class TBLogger:
    """A thin layer over ``SummaryWriter`` that knows the run's conventions (global step on
    every x-axis, one event file per session, ``purge_step`` when resuming)."""

    def __init__(self, log_dir: Path, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=30)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One point per tag at ``step``."""
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def config(self, cfg: Mapping[str, Any]) -> None:
        """The resolved config, as YAML in a code block (TensorBoard's Text tab)."""
        text = yaml.safe_dump(dict(cfg), sort_keys=False)
        self.writer.add_text("config", "```yaml\n" + text + "```", 0)

    def hparams_start(self, hparams: Mapping[str, Any]) -> None:
        """Open this run's HParams session with the hyperparameters it was given.

        Only the session is written, no per-run experiment summary: TensorBoard then builds
        the HParams table from the sessions of all runs under its logdir (the union of their
        hyperparameters) and offers every scalar tag of the runs as a metric, read as its latest
        value: whatever names the task logs (``val/acc``, ``val/mse``, ``best/val/...``)."""
        from torch.utils.tensorboard.summary import hparams as hp_summary

        clean = {k: _hparam_value(v) for k, v in hparams.items()}
        _, ssi, _ = hp_summary(clean, {})
        self.writer.file_writer.add_summary(ssi)

    def hparams_end(self, status: str) -> None:
        """Close the HParams session with the run's status."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.plugins.hparams.api_pb2 import Status
        from tensorboard.plugins.hparams.metadata import (
            PLUGIN_DATA_VERSION,
            PLUGIN_NAME,
            SESSION_END_INFO_TAG,
        )
        from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

        state = "STATUS_SUCCESS" if status in ("completed", "early_stopped") else "STATUS_FAILURE"
        content = HParamsPluginData(
            session_end_info=SessionEndInfo(status=Status.Value(state)),
            version=PLUGIN_DATA_VERSION,
        )
        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=content.SerializeToString()))
        self.writer.file_writer.add_summary(
            Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=metadata)]))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
