"""The loggers of a run as one object: what the trainer and callbacks call."""

from __future__ import annotations

import logging
from typing import Any, Mapping

log = logging.getLogger("ddpexp")


class Loggers(dict):
    """The run's loggers by name. Only global rank 0 has any: on the other ranks this is
    empty and every call is a no-op."""

    def open(self, run: Any) -> None:
        """Open each logger for ``run`` (a :class:`RunInfo`); a fresh run's hyperparameters
        go to each."""
        for logger in self.values():
            logger.open(run)
            if not run.resumed:
                logger.log_hparams(run.hparams)

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int) -> None:
        for logger in self.values():
            logger.log_metrics(metrics, step, epoch)

    def finalize(self, status: str) -> None:
        """End each logger with the run's status; one logger's failure to do so is a warning,
        never what the run is remembered by."""
        for name, logger in self.items():
            try:
                logger.finalize(status)
            except Exception as exc:
                log.warning("logger.%s could not finish: %s", name, exc)

    def state_dict(self) -> dict:
        return {name: logger.state_dict() for name, logger in self.items()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Each logger gets its saved state (a logger added since starts afresh)."""
        for name, logger in self.items():
            if name in saved:
                logger.load_state_dict(saved[name])
            else:
                log.warning("logger.%s has no state in the checkpoint: it starts afresh", name)
