"""A user callback that takes W&B's service process down mid-run: at step ``step`` global rank
0 SIGKILLs every ``wandb-core`` process its own process started, as a crashed or OOM-killed
service would end."""

from __future__ import annotations

import os
import signal
import subprocess

import ddpexp


class KillEverything(ddpexp.Callback):
    """At step ``step``, ``wait_s`` seconds after it, SIGKILL W&B's service and the run's whole
    process group at once, as a scheduler that kills a job's cgroup would: nothing is left to
    close a file."""

    def __init__(self, step: int, wait_s: float):
        self.step, self.wait_s = step, wait_s

    def on_train_batch_end(self, trainer):
        if not trainer.is_main or trainer.step != self.step:
            return
        import time

        time.sleep(self.wait_s)
        for pid in _services():
            os.kill(pid, signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _services() -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())],
                         capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "wandb" in line]


class KillService(ddpexp.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer):
        if trainer.is_main and trainer.step == self.step:
            _wait_until_stored(trainer.run_dir / "wandb", self.step - 1)
            out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())],
                                 capture_output=True, text=True, check=True).stdout
            pids = [int(line.split()[0]) for line in out.splitlines() if "wandb" in line]
            if not pids:
                raise RuntimeError("no W&B service process to kill")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)


class KillWhenStored(ddpexp.Callback):
    """At step ``step``, once W&B's offline files hold the points of step ``step - 1``, SIGKILL
    the run's whole process group, as ``kill -9`` of a job would (W&B's service, a session of
    its own, lives on and closes its file)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer):
        if not trainer.is_main or trainer.step != self.step:
            return
        _wait_until_stored(trainer.run_dir / "wandb", self.step - 1)
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _wait_until_stored(wandb_dir, step: int) -> None:
    """Until W&B's offline files under ``wandb_dir`` hold ``train/loss`` of ``step``."""
    import time

    from ddpexp.loggers.wandb import stored_steps

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        run_id = (wandb_dir / "ddpexp-run-id").read_text().strip()
        if stored_steps(wandb_dir, run_id).get("train/loss", -1) >= step:
            return
        time.sleep(0.1)
    raise RuntimeError(f"W&B never stored step {step}")
