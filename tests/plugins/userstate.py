"""User callbacks as many users write them: state kept in numpy arrays and scalars, state a
checkpoint cannot hold, and one that stops its own run with a real SIGTERM (plugged in with
``+callbacks.NAME._target_=userstate...`` or a ``callbacks/*.yaml`` of a config dir)."""

from __future__ import annotations

import os
import signal

import numpy as np

from ddpexp import Callback


class NumpyStats(Callback):
    """Keeps, per epoch, the validation loss as a numpy scalar and a running array."""

    def __init__(self) -> None:
        self.losses = np.zeros(0, dtype=np.float32)
        self.best = np.float64(np.inf)
        self.epochs = np.int64(0)
        self.loaded: dict = {}

    def on_validation_end(self, trainer, metrics) -> None:
        self.losses = np.append(self.losses, np.float32(metrics["val/loss"]))
        self.best = min(self.best, np.float64(metrics["val/loss"]))
        self.epochs += 1

    def state_dict(self) -> dict:
        return {"losses": self.losses, "best": self.best, "epochs": self.epochs,
                "seen": [np.int32(len(self.losses)), "epochs"]}

    def load_state_dict(self, state) -> None:
        self.loaded = dict(state)
        self.losses, self.best, self.epochs = state["losses"], state["best"], state["epochs"]


class Handle:
    """Something no safe load builds."""


class Unsaveable(Callback):
    """Keeps an object a checkpoint cannot hold."""

    def state_dict(self) -> dict:
        return {"ok": np.arange(3), "nested": {"handle": Handle()}}


class SigtermAt(Callback):
    """Sends its own process SIGTERM after optimizer step ``step`` of a run that is not a
    resume: the run stops there as a cluster's preemption would stop it."""

    def __init__(self, step: int = 3) -> None:
        self.step = step

    def on_train_batch_end(self, trainer) -> None:
        if not trainer.resumed and trainer.step == self.step and trainer.is_main:
            os.kill(os.getpid(), signal.SIGTERM)


class GradLogger(Callback):
    """Logs a value about each optimizer step's gradients, before the step."""

    def on_before_optimizer_step(self, trainer) -> None:
        trainer.log_metrics({"probe/steps_done": float(trainer.step)})
