"""Run the real CLI in its own session with a timeout, make sure no process of it outlives
the test, and read back what a run wrote (run dirs, metrics.json, TensorBoard scalars)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

# The tests read a run's metrics.json as ddpexp itself does.
from ddpexp.record import read_metrics  # noqa: F401

# Small, fast settings shared by the end-to-end tests.
FAST = ["trainer.max_epochs=2", "trainer.log_every_n_steps=5"]
# The user callbacks and models of the tests (tests/plugins), importable by a run's workers.
PLUGINS = str(Path(__file__).parents[1] / "plugins")


def plugins_env() -> dict:
    """The environment for a CLI run that imports from tests/plugins (``+callbacks.x._target_
    =module.Class``), keeping the PYTHONPATH this test runs under."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}


def session_pids(sid: int) -> list[int]:
    """Processes still alive in session ``sid`` (everything a CLI run started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields: state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def kill_session(sid: int) -> list[int]:
    """SIGKILL every process left in session ``sid``; the pids it found."""
    left = session_pids(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (or gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def stop_session(sid: int, timeout: float = 10) -> None:
    """SIGSTOP every process of session ``sid`` and return once every thread of each is
    stopped: a signal is delivered asynchronously, and a thread inside a system call (a
    checkpoint writer's rename) finishes it before it stops."""
    os.killpg(sid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(_stopped(pid) for pid in session_pids(sid)):
        if time.monotonic() > deadline:
            raise AssertionError(f"session {sid} did not stop within {timeout} s")
        time.sleep(0.02)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[int]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def start_cli(args: Sequence[str], cwd: Path, env: dict | None = None,
              module: str = "ddpexp", stderr_to: Path | None = None) -> subprocess.Popen:
    """Start ``python -m ddpexp ARGS`` in a new session (so the whole tree can be found).
    ``stderr_to``: a file that takes its stderr (read while it runs) instead of a pipe."""
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    if stderr_to is None:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=cwd, env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
    with stderr_to.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=cwd, env=full_env,
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        )


def finish(proc: subprocess.Popen, timeout: float) -> CliResult:
    """Wait for ``proc``; on timeout kill its session. Reports processes it left behind."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s\nSTDOUT:\n{out}\nSTDERR:\n{err}")
    deadline = time.time() + 10
    while session_pids(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    return CliResult(proc.returncode, out, err, kill_session(proc.pid))


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120,
             nonempty: bool = False) -> None:
    """Wait until ``path`` exists (``nonempty``: and holds something) while ``proc`` runs;
    fail the test with its output if it ends first or ``timeout`` passes."""
    deadline = time.time() + timeout
    while not path.exists() or (nonempty and not path.stat().st_size):
        if proc.poll() is not None or time.time() > deadline:
            res = finish(proc, 10)
            pytest.fail(f"{path} never appeared (exit {res.returncode})\n{res.output}")
        time.sleep(0.05)


def run_cli(args: Sequence[str], cwd: Path, timeout: float = 180, env: dict | None = None,
            expect_ok: bool = True, module: str = "ddpexp") -> CliResult:
    """Run the CLI to completion; by default fail the test unless it exits 0."""
    res = finish(start_cli(args, cwd, env, module), timeout)
    assert not res.leftovers, f"processes left behind: {res.leftovers}"
    if expect_ok:
        assert res.returncode == 0, f"exit {res.returncode}\nSTDOUT:\n{res.stdout}\nSTDERR:\n{res.stderr}"
    return res


def run_printed(line: str, cwd: Path, timeout: float = 180, env: dict | None = None) -> CliResult:
    """Run a command line that ddpexp printed (``python -m ddpexp ...``) as a user pastes
    it into a shell: ``bash -c LINE``, with this interpreter's ``python`` first on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update({"PYTHONUNBUFFERED": "1", "PATH": path, **(env or {})})
    proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    res = finish(proc, timeout)
    assert not res.leftovers, f"processes left behind: {res.leftovers}"
    assert res.returncode == 0, f"{line}: exit {res.returncode}\n{res.output}"
    return res


def run_dirs(root: Path) -> list[Path]:
    """Run dirs (those with a .hydra/config.yaml) under ``root``, oldest first."""
    return sorted(p.parent.parent for p in root.glob("**/.hydra/config.yaml")
                  if p.parent.name == ".hydra")


def only_run_dir(root: Path) -> Path:
    """The one run dir under ``root/outputs`` (fails the test if there are none or several)."""
    dirs = run_dirs(root / "outputs")
    assert len(dirs) == 1, dirs
    return dirs[0]


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``log_dir``'s event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


_FAN_OUT = ("trainer.procs", "trainer.gpus", "trainer.nodes", "trainer.max_restarts")


def one_worker(args: Sequence[str]) -> bool:
    """Whether ``args`` make one run of one worker on the CPU (no sweep, no fan-out, no
    restarts): a run that ``python -m ddpexp`` does in its own process, so a test may too."""
    for arg in args:
        if arg in ("-m", "--multirun"):
            return False
        key, _, value = arg.partition("=")
        if key.lstrip("+") in _FAN_OUT and value not in ("null", "0", "1"):
            return False
        if key.lstrip("+") == "trainer.gpus" and value == "1":
            return False
    return True


def _end_the_call(code: int = 0) -> None:  # the real exit_now ends the process
    raise SystemExit(code)


def _as_at_start() -> None:
    """Hydra's version base as ``@hydra.main(version_base="1.3")`` set it when ddpexp's
    ``__main__`` was first imported: the fixture that resets Hydra's singletons between tests
    drops it, and without it Hydra would change the working dir of the job (1.1's default)."""
    from hydra import version

    version.setbase("1.3")


def run_cli_in_process(args: Sequence[str], cwd: Path, env: dict | None = None,
                       expect_ok: bool = True) -> CliResult:
    """:func:`run_cli` for a run of one worker, in this process: the same :class:`CliResult`
    (what the CLI wrote to stdout and to stderr), without the seconds a fresh interpreter
    takes to start and import torch. ``env`` may set variables and prepend to PYTHONPATH
    (a user's module dir); modules imported from there are forgotten afterwards."""
    import contextlib
    import io

    import ddpexp.launch.proc
    from ddpexp.__main__ import cli

    assert one_worker(args), f"{args} start more than one process: use run_cli"
    out, err = io.StringIO(), io.StringIO()
    added: list[str] = []
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in (env or {}).items():
            if key == "PYTHONPATH":
                added = [p for p in value.split(os.pathsep) if p and p not in sys.path]
                for path in reversed(added):
                    mp.syspath_prepend(path)
            else:
                mp.setenv(key, value)
        mp.chdir(cwd)
        mp.setattr(sys, "argv", ["ddpexp", *args])
        mp.delenv("HYDRA_FULL_ERROR", raising=False)
        mp.setattr(ddpexp.launch.proc, "exit_now", _end_the_call)
        code: object = 0
        _as_at_start()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli()
            except SystemExit as exc:
                code = exc.code
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if any(where.startswith(path) for path in added):
            del sys.modules[name]
    status = code if isinstance(code, int) else (0 if code is None else 1)
    res = CliResult(status, out.getvalue(), err.getvalue() + (code if isinstance(code, str) else ""), [])
    if expect_ok:
        assert res.returncode == 0, f"exit {res.returncode}\nSTDOUT:\n{res.stdout}\nSTDERR:\n{res.stderr}"
    return res


def run_cli_here(args: Sequence[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    """``python -m ddpexp ARGS`` in this process (Hydra's ``main`` included): its exit status
    and everything it printed. Milliseconds instead of a subprocess's seconds; for runs of
    one worker (several need processes of their own anyway)."""
    import ddpexp.launch.proc
    from ddpexp.__main__ import cli

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["ddpexp", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(ddpexp.launch.proc, "exit_now", _end_the_call)
    capsys.readouterr()  # what the test printed before is not the CLI's
    _as_at_start()
    with pytest.raises(SystemExit) as exited:
        cli()
    code = exited.value.code
    out = capsys.readouterr()
    status = code if isinstance(code, int) else 1  # sys.exit("message") exits 1
    return status, out.out + out.err + (code if isinstance(code, str) else "")
