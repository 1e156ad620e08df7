"""A user callback that takes a tracking server down mid-run: at step ``step`` global rank 0
waits until the server holds some of the run's points, SIGKILLs the server's process group
and writes the time it did so to ``stamp``."""

from __future__ import annotations

import os
import signal
import time

import ddpexp


class KillServer(ddpexp.Callback):
    def __init__(self, pgid: int, step: int, stamp: str, url: str):
        self.pgid, self.step, self.stamp, self.url = pgid, step, stamp, url

    def on_train_batch_end(self, trainer):
        if trainer.is_main and trainer.step == self.step:
            self._wait_for_points()
            os.killpg(self.pgid, signal.SIGKILL)
            with open(self.stamp, "w") as f:
                f.write(str(time.time()))

    def _wait_for_points(self) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.url)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            experiment = client.get_experiment_by_name("ddpexp")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            if runs and runs[0].data.metrics:
                return
            time.sleep(0.2)
        raise RuntimeError("the tracking server never got a point")
