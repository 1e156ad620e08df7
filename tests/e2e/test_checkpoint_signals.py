"""Stopping on a signal: SIGTERM/SIGINT (and SLURM's pre-timeout SIGUSR2 under submitit) make
every worker stop at a step boundary, rank 0 checkpoint, and the run exit non-zero with a
message saying how to resume; resuming then ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    finish,
    read_metrics,
    run_cli,
    run_cli_in_process,
    run_dirs,
    run_printed,
    session_pids,
    start_cli,
    wait_for,
)
from test_checkpoint_resume import assert_same_final_state, assert_tensorboard_continues, new_run

from ddpexp.config.commands import command_line_override

# No schedule (so the run's length does not shape the lr) and a huge max_epochs: the signal
# always lands mid-run however slow the machine is; the resumed and the reference runs then
# stop a couple of epochs after the stop point.
LONG = [
    "data=synthetic", "data.shape=[1,4,4]", "data.num_classes=3", "data.num_samples=96",
    "data.val_samples=32", "data.batch_size=8", "data.noise=3.0", "model=mlp",
    "model.hidden=[16]", "model.dropout=0.5", "trainer.log_every_n_steps=2",
    "trainer.ckpt_every_steps=3",
    # Trained for long on noise, the loss may rise far past its start: divergence is not what
    # these runs are about (tests/e2e/test_divergence.py is).
    "trainer.divergence_factor=null",
]
HUGE = "trainer.max_epochs=100000"


def interrupt(workdir: Path, args: list[str], sig: int, env: dict | None = None,
              group: bool = False):
    """Start a long run in its own dir, signal the CLI process (``group``: its whole process
    group, as Ctrl-C in a terminal does) once it has checkpointed, and return (run dir,
    result, seconds from the signal to every process gone)."""
    run_dir = workdir / "outputs" / f"run-{sig}"
    proc = start_cli([*args, HUGE, f"hydra.run.dir={run_dir}"], workdir, env)
    wait_for(run_dir / "checkpoints" / "last.pt", proc)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    sent = time.time()
    res = finish(proc, 90)
    return run_dir, res, time.time() - sent


def check_interrupted(run_dir: Path, res, took: float, name: str) -> dict:
    assert not res.leftovers, f"processes left behind: {res.leftovers}"
    assert took < 60, took
    assert res.returncode == 128 + signal.Signals[name], res.stderr  # as a shell reports it
    assert "Traceback" not in res.output, res.output
    assert f"{command_line_override('resume', run_dir)} " in res.stderr, res.stderr
    assert f"{name}: stopped at epoch" in res.output
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "interrupted"
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["step"] == metrics["steps"] > 0
    return ckpt


def check_resume_matches(workdir: Path, run_dir: Path, args: list[str], ckpt: dict,
                         env: dict | None = None, how: list[str] | None = None) -> None:
    """Resume to two epochs past the stop; compare with a run of that length from scratch.
    ``how`` is the resume override (default ``resume=<run dir>``)."""
    length = f"trainer.max_epochs={ckpt['epoch'] + 2}"
    how = how or [f"resume={run_dir}"]
    res = run_cli([*args, length, *how], workdir, env=env)
    assert "resumed from" in res.output
    reference = new_run(workdir, [*args, length])
    assert_same_final_state(run_dir, reference)


@pytest.mark.slow
def test_sigterm_two_workers(workdir):
    args = [*LONG, "trainer.procs=2"]
    run_dir, res, took = interrupt(workdir, args, signal.SIGTERM)
    ckpt = check_interrupted(run_dir, res, took, "SIGTERM")
    assert ckpt["world_size"] == 2
    check_resume_matches(workdir, run_dir, args, ckpt)


PLUGINS = str(Path(__file__).parents[1] / "plugins")


@pytest.mark.slow
def test_the_printed_command_continues_a_config_dir_run_to_the_end(workdir):
    """One process, a callback of the user's config dir, a run dir with a space in it, ``~``
    and ``+`` overrides: SIGTERM (sent by the callback at step 5) stops it with a checkpoint,
    and the command it prints, run as it is by a shell, continues it to the same end as an
    uninterrupted run."""
    conf = workdir / "my conf" / "callbacks"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("defaults:\n  - default\nstop:\n  _target_: userstate.SigtermAt\n")
    env = {"PYTHONPATH": os.pathsep.join([PLUGINS, os.environ.get("PYTHONPATH", "")])}
    length = ["trainer.max_epochs=2", "~callbacks.lr_monitor"]
    args = ["--config-dir", str(workdir / "my conf"), "callbacks=mine", "+callbacks.stop.step=5",
            *LONG, *length, "hydra.run.dir=outputs/my\\ run"]
    res = finish(start_cli(args, workdir, env), 120)
    run_dir = workdir / "outputs" / "my run"
    ckpt = check_interrupted(run_dir, res, 0, "SIGTERM")
    assert ckpt["step"] == 5
    printed = res.stderr.split("Continue it with:\n", 1)[1].splitlines()[0].strip()
    assert "--config-dir" in printed and "+callbacks.stop.step=5" in printed, printed
    res = run_printed(printed, workdir, 120, env)
    assert f"resumed from {run_dir}/checkpoints/last.pt at epoch 0, batch 5, step 5" in res.output
    reference = workdir / "outputs" / "reference"
    run_cli_in_process([*LONG, *length, f"hydra.run.dir={reference}"], workdir)
    assert_same_final_state(run_dir, reference)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_two_workers(workdir):
    """Ctrl-C reaches the agent and the workers at once, and the agent forwards it again: the
    workers must still checkpoint (a second SIGINT under the agent does not abort them)."""
    args = [*LONG, "trainer.procs=2"]
    run_dir, res, took = interrupt(workdir, args, signal.SIGINT, group=True)
    ckpt = check_interrupted(run_dir, res, took, "SIGINT")
    check_resume_matches(workdir, run_dir, args, ckpt, how=["resume=auto", f"hydra.run.dir={run_dir}"])


SUBMITIT_ENV = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242"}


@pytest.mark.slow
# Two workers only: one process takes the same path, and tests/e2e/test_slurm.py requeues a real
# SLURM job.
@pytest.mark.parametrize("procs", [2])
def test_slurm_pre_timeout_signal_checkpoints_and_requeue_continues(workdir, procs):
    """Under submitit, SIGUSR2 (SLURM's --signal=USR2@90 that submitit asks for) stops the run
    with a checkpoint; the requeued job, the same command in the same job dir without any
    resume=, continues from it."""
    args = [*LONG, f"trainer.procs={procs}"]
    run_dir, res, took = interrupt(workdir, args, signal.SIGUSR2, env=SUBMITIT_ENV)
    ckpt = check_interrupted(run_dir, res, took, "SIGUSR2")
    assert read_metrics(run_dir)["stopped_by"] == "SIGUSR2"
    check_resume_matches(workdir, run_dir, args, ckpt, env=SUBMITIT_ENV,
                         how=[f"hydra.run.dir={run_dir}"])


def test_sigusr2_is_not_a_stop_signal_outside_slurm(monkeypatch):
    from ddpexp.runtime.signals import stop_signals

    for key in list(os.environ):
        if key.startswith(("SUBMITIT_", "SLURM_")):
            monkeypatch.delenv(key)
    assert stop_signals() == (signal.SIGTERM, signal.SIGINT)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert stop_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert stop_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _submitit_task(sid: int) -> int | None:
    """The pid of the submitit task (the process running the Hydra job) in session ``sid``."""
    for pid in session_pids(sid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmdline:
            return pid
    return None


@pytest.mark.slow
def test_submitit_local_preemption_requeues_and_continues(workdir):
    """End to end with Hydra's submitit_local launcher: SIGUSR2 to the job checkpoints,
    submitit requeues the job, and the requeued job continues to the uninterrupted result."""
    args = [*LONG, "trainer.max_epochs=40"]  # a few seconds of training: the signal lands mid-run
    sweep = workdir / "sweep"
    proc = start_cli(["-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}", *args],
                     workdir)
    wait_for(sweep / "0" / "checkpoints" / "last.pt", proc)
    task = _submitit_task(proc.pid)
    assert task is not None, "no submitit task process found"
    os.kill(task, signal.SIGUSR2)
    res = finish(proc, 300)
    assert not res.leftovers and res.returncode == 0, res.output
    run_dir = sweep / "0"
    log = (run_dir / "ddpexp.log").read_text()
    assert "SIGUSR2: stopped at epoch" in log
    assert "handing the signal to submitit to requeue the job" in log
    assert f"requeued submitit job: continuing {run_dir}/checkpoints/last.pt" in log
    reference = new_run(workdir, args)
    assert_same_final_state(run_dir, reference)


@pytest.mark.slow
def test_worker_killed_group_restarts_from_last_checkpoint(workdir):
    """trainer.max_restarts: SIGKILL of one worker restarts the group, which resumes from
    last.pt and ends exactly where an uninterrupted run ends, TensorBoard without repeats."""
    args = [*LONG, "trainer.procs=2", "trainer.max_epochs=30"]
    run_dir = workdir / "outputs" / "restarted"
    proc = start_cli([*args, "trainer.max_restarts=1", f"hydra.run.dir={run_dir}"], workdir)
    wait_for(run_dir / "checkpoints" / "last.pt", proc)
    # The workers are the CLI process's children (forked on the CPU), bar multiprocessing's
    # resource tracker.
    workers = [pid for pid in session_pids(proc.pid)
               if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid)
               and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    res = finish(proc, 180)
    assert not res.leftovers and res.returncode == 0, res.output
    assert "restart 1 of the worker group: resuming from" in res.output
    reference = new_run(workdir, args)
    assert_same_final_state(run_dir, reference)
    assert_tensorboard_continues(run_dir, reference)


def test_a_second_sigint_still_leaves_a_status(workdir):
    """Ctrl-C twice on one worker: the second interrupts at once (no checkpoint), and
    metrics.json says interrupted rather than running."""
    run_dir = workdir / "run"
    proc = start_cli([*LONG, HUGE, f"hydra.run.dir={run_dir}"], workdir)
    wait_for(run_dir / "metrics.json", proc)  # the first epoch is done: the run is training
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)  # two signals at once would count as one
    proc.send_signal(signal.SIGINT)
    res = finish(proc, timeout=60)
    assert not res.leftovers
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "interrupted"
    assert "second SIGINT" in metrics.get("error", "") or metrics.get("stopped_by") == "SIGINT"


EARLY = ["data=synthetic", "data.shape=[6]", "data.num_classes=3", "data.num_samples=64",
         "data.val_samples=32", "data.test_samples=0", "model=mlp", "model.hidden=[16]",
         "trainer.max_epochs=1"]


def test_one_ctrl_c_before_the_first_checkpoint_lets_the_same_command_start_again(workdir):
    """Ctrl-C (to the process group, as a terminal sends it) while the data loads, before
    the trainer listens for signals: the run ends interrupted, saying so once (no talk of a
    second SIGINT, no traceback), and the same command then starts it again in its dir."""
    started, run_dir = workdir / "loading", workdir / "outputs" / "early"
    env = {"PYTHONPATH": os.pathsep.join([PLUGINS, os.environ.get("PYTHONPATH", "")])}
    args = [*EARLY, "data._target_=slowdata.SlowSynthetic", f"+data.started={started}",
            f"hydra.run.dir={run_dir}"]
    proc = start_cli(args, workdir, env)
    wait_for(started, proc)
    os.killpg(proc.pid, signal.SIGINT)
    res = finish(proc, 60)
    assert not res.leftovers and res.returncode == 130, res.stderr
    assert "Traceback" not in res.output and "second" not in res.output, res.output
    assert res.stderr.startswith("stopped by SIGINT before training began; no checkpoint was "
                                 "saved yet."), res.stderr
    assert f"resume=auto {command_line_override('hydra.run.dir', run_dir)} " in res.stderr
    assert read_metrics(run_dir)["status"] == "interrupted"
    again = run_cli(args, workdir, env=env)
    assert "completed: 1 epochs" in again.output
    assert read_metrics(run_dir)["status"] == "completed"


def test_ctrl_c_while_python_starts_is_one_line_and_no_run_dir(workdir):
    """Ctrl-C while Python imports and Hydra is yet to compose the config: exit status 130,
    one line, no traceback, and no run dir. The moment is read, not guessed: Python's
    import-time log (-X importtime, on stderr) names each module as its import ends, and
    the signal goes as soon as the CLI has imported what it imports once its own Ctrl-C
    handler is in place (ddpexp.launch.world), long before a run dir is made."""
    log = workdir / "stderr.txt"
    proc = start_cli(EARLY, workdir, env={"PYTHONPROFILEIMPORTTIME": "1"}, stderr_to=log)
    deadline = time.time() + 60
    while not log.read_text().rstrip(" ").count("| ddpexp.launch.world\n"):
        if proc.poll() is not None or time.time() > deadline:
            res = finish(proc, 10)
            pytest.fail(f"ddpexp.launch.world never imported (exit {res.returncode})\n"
                        f"{res.stdout}{log.read_text()[-3000:]}")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    res = finish(proc, 60)
    stderr = "".join(line for line in log.read_text().splitlines(keepends=True)
                     if not line.startswith("import time:"))
    assert not res.leftovers
    assert res.returncode == 130, res.stdout + stderr
    assert stderr == "stopped by SIGINT before the run started; nothing was saved\n"
    assert not run_dirs(workdir / "outputs")
