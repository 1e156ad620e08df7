"""What a failed run leaves behind and how an operating-system error is told to the user.

:func:`guard_run` wraps the task function: the run holds its dir's lock while it runs
(:mod:`ddpexp.config.runlock`; a dir another live run holds is refused before anything is
written), releases it however the run ends, and whatever way a run fails, the run dir ends in a
state the user can act on. A mistake found before the first step leaves no run dir: a
run's dir that holds nothing but Hydra's config, the log and the failure's record is
removed (a sweep job's stays, its error in its row); its message is the run's only output
(Hydra's "Error executing job" line is not printed before it); a resume that
failed before it wrote a checkpoint takes its ``.hydra/resume-N`` with it; a Ctrl-C that
comes before the trainer listens for it (or a second one) marks ``metrics.json`` interrupted
instead of leaving it ``running``, and says how to start or continue the run
(:func:`resume_hint`); and an ``OSError``
(an unreadable ``data.root``, a read-only or full disk) becomes one message naming the file
and the fix. :func:`explain_os_error` does the last for workers too.

When workers fail, one message names each failed rank and its cause, whoever started them:
:func:`describe_elastic_failure` for torch elastic's agent, :func:`describe_step_failure` for a
SLURM step's ranks (each rank's own cause from :func:`rank_error`); ranks that only lost their
connection to the failed one are not counted as causes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from ddpexp import errors
from ddpexp.config.cli import env_flag
from ddpexp.config.commands import continue_sweep, resume_command
from ddpexp.config.rundir import (
    claimed_dirs,
    drop_empty_parent,
    drop_unused_claims,
    has_checkpoint,
    lock_run_dir,
)
from ddpexp.config.runlock import LOCK_FILE, release
from ddpexp.errors import ConfigError, DdpexpError, RunDirBusy, RunInterrupted
from ddpexp.launch.resources import oom_kills
from ddpexp.launch.world import detect
from ddpexp.record import METRICS_FILE, read_metrics_or_empty, record_failure, run_started
from ddpexp.runtime.signals import SecondSignal

# Files written into a run dir before the task runs: Hydra's config, the run's lock.
_HYDRA_ONLY = {".hydra", LOCK_FILE}


def explain_os_error(exc: OSError, data_root: str | None = None,
                     run_dir: str | None = None, sweep_dir: str | None = None) -> DdpexpError:
    """``exc`` as one message: which file, what is wrong, which key or action fixes it.
    An error that names no file (a write that failed when its file was closed, deep in a
    library) is placed in the run dir, where the run writes."""
    bases = {"data.root": data_root, "hydra.run.dir": run_dir, "hydra.sweep.dir": sweep_dir}
    if exc.filename:
        name, where = str(exc.filename), _key_for(str(exc.filename), bases)
    else:
        name, where = f"a file in {run_dir or 'the run dir'}", "hydra.run.dir"
    if exc.errno == errno.ENOSPC:
        return ConfigError(
            f"no space left on the device that holds {name}. Free some space there, or point "
            f"{where} at another disk (nothing already saved was replaced by a partial file)")
    if exc.errno == errno.EDQUOT:
        return ConfigError(f"disk quota exceeded writing {name}. Free some space, or point "
                           f"{where} at another disk")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ConfigError(f"permission denied: {name}. Give this user access to it, or "
                           f"point {where} at a place it can use")
    if exc.errno == errno.EROFS:
        return ConfigError(f"{name} is on a read-only file system; point {where} at a "
                           "writable place")
    return ConfigError(f"{exc.strerror or exc}: {name} (check {where})")


def _key_for(filename: str, bases: dict[str, str | None]) -> str:
    """The key whose dir (``bases``: key -> dir) holds ``filename``."""
    path = Path(filename).absolute()
    for key, base in bases.items():
        if base and (path == Path(base).absolute() or Path(base).absolute() in path.parents):
            return key
    return "data.root or hydra.run.dir"


def guard_run(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap the task function (``launch.run``) with the clean-up described above."""

    @functools.wraps(task)
    def guarded(cfg: Any) -> Any:
        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        if hydra_cfg.mode == RunMode.RUN:
            drop_unused_claims(run_dir)
        try:
            # Taken already, where Hydra resolved hydra.output_subdir; a refusal then left
            # no config behind, and leaves now before anything else is written.
            lock_run_dir(run_dir, cfg)
        except RunDirBusy as exc:
            release(run_dir)
            _report(exc, hydra_cfg)
        try:
            return _guarded(task, cfg, hydra_cfg, run_dir)
        finally:
            release(run_dir)

    return guarded


def _guarded(task: Callable[[Any], Any], cfg: Any, hydra_cfg: Any, run_dir: Path) -> Any:
    """:func:`guard_run`'s clean-up around one call of ``task``."""
    config_dir = _newest_config_dir(run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    last_before = _stamp(last)
    started = run_started()
    try:
        with quiet_logging_errors():
            return task(cfg)
    except KeyboardInterrupt as interrupt:
        # Raised by Python's own handler for a Ctrl-C that came while the trainer did not
        # listen for it (while the data loads, say, or during the test of best.pt), or by
        # the trainer's for a second one.
        when = ("a second SIGINT, before the checkpoint of the first was saved" if
                isinstance(interrupt, SecondSignal) else "SIGINT" if has_checkpoint(run_dir)
                else "SIGINT before training began")
        exc: BaseException = RunInterrupted(f"stopped by {when}; " + resume_hint(
            run_dir, hydra_cfg), signal="SIGINT")
        record_failure(run_dir, exc, started)
        _ignore_further_interrupts()
        _report(exc, hydra_cfg)
    except BaseException as err:
        exc = err
        if isinstance(err, OSError):
            root = _select(cfg, "data.root")
            exc = explain_os_error(err, str(root) if root else None, str(run_dir))
            record_failure(run_dir, exc, started)
        if isinstance(exc, RunInterrupted):
            _ignore_further_interrupts()
        else:
            _tidy(run_dir, config_dir, last, last_before, hydra_cfg)
        if exc is err and not isinstance(exc, DdpexpError):
            raise
        _report(exc, hydra_cfg)


def resume_hint(run_dir: Path, hydra_cfg: Any = None) -> str:
    """How to go on after an interruption: the command line that started the run (or its
    sweep), every flag and override kept, the launcher's too, with ``resume=<run dir>``
    (``resume=auto`` and the sweep dir). A run that saved no checkpoint yet starts again
    from scratch in the same run dir: ``resume=auto hydra.run.dir=<run dir>``."""
    if hydra_cfg is None and HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
        return (f"the last checkpoint is in {run_dir}/checkpoints. To continue the sweep, "
                + continue_sweep(Path(str(hydra_cfg.sweep.dir)).absolute()))
    world = detect()
    prefix = world.command() if world is not None else "python -m ddpexp"
    if not has_checkpoint(run_dir):
        command = resume_command(sys.argv[1:], run_dir=run_dir, prefix=prefix, fresh=True)
        return f"no checkpoint was saved yet. Start it again in {run_dir} with:\n  {command}"
    command = resume_command(sys.argv[1:], run_dir=run_dir, prefix=prefix)
    return f"the last checkpoint is in {run_dir}/checkpoints. Continue it with:\n  {command}"


@contextlib.contextmanager
def quiet_logging_errors() -> Iterator[None]:
    """A log file that cannot take a line (a full disk) loses it quietly, instead of
    printing "--- Logging error ---" and a traceback on the terminal for every line: what
    failed is reported once, by the run's message."""
    before = logging.raiseExceptions
    logging.raiseExceptions = False
    try:
        yield
    finally:
        logging.raiseExceptions = before


def _report(exc: BaseException, hydra_cfg: Any) -> NoReturn:
    """End a run with ddpexp's message ``exc``. A run on its own leaves with it as its exit
    message: raised on, Hydra would print "Error executing job with overrides: [...]" first.
    A sweep's job raises it for the launcher, which puts it in the job's row;
    ``HYDRA_FULL_ERROR=1`` raises it too, for the whole traceback. A run a signal stopped
    exits as a shell reports a command that signal ended, 128 + its number (130 for Ctrl-C),
    whether it came before training began or during it; other failures exit 1."""
    if hydra_cfg.mode == RunMode.RUN and not env_flag("HYDRA_FULL_ERROR"):
        signum = _signal_number(exc.signal) if isinstance(exc, RunInterrupted) else None
        if signum is None:
            raise SystemExit(str(exc)) from None
        print(exc, file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    raise exc from None


def _signal_number(name: str | None) -> int | None:
    """The number of the signal called ``name`` (``"SIGINT"``), where it is one."""
    try:
        return int(signal.Signals[name]) if name else None
    except KeyError:
        return None


def _ignore_further_interrupts() -> None:
    """A run stopped by Ctrl-C has saved what it could and is reporting how to continue; a
    second Ctrl-C in that moment would only replace the message by a traceback. (Each run
    installs its own handlers while it trains.)"""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tidy(run_dir: Path, config_dir: Path, last: Path, last_before: Any, hydra_cfg: Any) -> None:
    """Remove what a failed run added without doing any work: a run dir of its own that holds
    only Hydra's config, the log and the record of a failure before the first step (a
    mistake found then leaves no run dir), or the ``.hydra/resume-N`` of a failed resume."""
    log_name = f"{hydra_cfg.job.name}.log"
    if hydra_cfg.mode == RunMode.RUN and config_dir == run_dir / ".hydra" and \
            _untouched(run_dir, log_name):
        for entry in run_dir.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        claimed = str(run_dir) in claimed_dirs()
        if claimed or not any(run_dir.iterdir()):
            shutil.rmtree(run_dir, ignore_errors=True)
        if claimed:
            drop_empty_parent(run_dir)  # the outputs/<date> it was the first run of
        return
    if config_dir.name.startswith("resume-") and _stamp(last) == last_before:
        shutil.rmtree(config_dir, ignore_errors=True)


def _untouched(run_dir: Path, log_name: str) -> bool:
    """Whether ``run_dir`` holds nothing but what every run writes before its first step:
    Hydra's config, the run's log ``log_name``, and a ``metrics.json`` that counts no step."""
    if not run_dir.is_dir():
        return False
    for entry in run_dir.iterdir():
        if entry.name in (*_HYDRA_ONLY, log_name):
            continue
        if entry.name == METRICS_FILE and not read_metrics_or_empty(run_dir).get("steps"):
            continue
        return False
    return True


def _newest_config_dir(run_dir: Path) -> Path:
    """The ``.hydra`` subdir Hydra just wrote this run's config to: ``.hydra/resume-N`` with
    the largest N when the dir held a run already. (Resolving ``hydra.output_subdir`` again
    would name the next one.)"""
    resumes = [p for p in (run_dir / ".hydra").glob("resume-*") if p.name[7:].isdigit()]
    if not resumes:
        return run_dir / ".hydra"
    return max(resumes, key=lambda p: int(p.name[7:]))


def _stamp(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _select(cfg: Any, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=None)
    except Exception:
        return None

# ------------------------------------------------------------------ a failed run's message
# What a rank's collective says when another rank went away: a consequence, not a cause.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "connection closed", "Connection refused")


def describe_elastic_failure(exc: Any, oom_kills_before: int | None = None,
                      log_file: str | None = None, ranks: Any = ()) -> str:
    """One message naming each failed rank and its cause (the first line of its error).
    A mistake every failed rank reports alike (a ddpexp error, such as a shape check on the
    first batch) is said once, as it is.

    The agent reports the ranks it saw fail first, which can be a rank whose collective broke
    because the real culprit had just closed its sockets. Every rank that raised has written
    its traceback into the run's log, so ranks the agent missed are added from there, and
    causes of their own come before lost connections. A rank of ``ranks`` (this node's) that
    neither the agent nor the log names, while the others only lost their connection, died
    without a Python error: a signal killed it."""
    same = {_own_error(f) for f in exc.failures.values()}
    if len(same) == 1 and None not in same:
        return same.pop()  # pyright: ignore[reportReturnType]  # None is not in the set (checked above)
    oom = oom_kills_before is not None and (oom_kills() or 0) > oom_kills_before
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        cause = _exit_cause(failure)
        if cause == "was killed by SIGKILL":
            cause += (" from the kernel's out-of-memory killer: memory ran out (use fewer "
                      "trainer.procs, a smaller data.batch_size or model)" if oom else
                      " (by another process, or by the kernel when memory ran out)")
        lines.append(f"rank {rank} (pid {failure.pid}) {cause}")
    for rank, (pid, last) in sorted(_logged_failures(log_file).items()):
        if rank not in exc.failures:
            lines.append(f"rank {rank} (pid {pid}) raised {last}")
    lost = [any(k in line for k in PEER_LOST) for line in lines]
    if lines and all(lost):
        named = set(exc.failures) | set(_logged_failures(log_file))
        for rank in sorted(set(ranks) - named):
            lines.append(f"rank {rank} was killed by a signal without a Python error (SIGKILL "
                         + ("from the kernel's out-of-memory killer)" if oom else
                            "from another process, or the kernel when memory ran out)"))
        lost = [any(k in line for k in PEER_LOST) for line in lines]
    if not all(lost):  # the ranks that lost a peer only echo the others' failure
        lines = [line for line, echo in zip(lines, lost, strict=True) if not echo] + [
            line.split(" raised ")[0] + " lost its connection to the failed rank(s)"
            for line, echo in zip(lines, lost, strict=True) if echo]
    causes = {_own_cause(line) for line in lines if not any(k in line for k in PEER_LOST)}
    if len(causes) == 1 and None not in causes:
        # One ddpexp error (a full disk, named) that the others only echo: said once, as a
        # rank that the agent saw first would have said it.
        return causes.pop()  # pyright: ignore[reportReturnType]  # None is not in the set (checked above)
    head = "a worker failed, so the whole run was stopped:" if len(lines) == 1 else \
        f"{len(lines)} workers failed, so the whole run was stopped:"
    text = head + "\n  " + "\n  ".join(lines)
    if any("Timed out" in line or "timed out" in line for line in lines):
        text += (
            "\n(a collective waited longer than trainer.dist_timeout_s: another rank stalled, "
            "e.g. stuck in data loading or a deadlock, or skipped a collective)"
        )
    return text


def describe_own_failure(exc: BaseException) -> str:
    """The message of a run whose one worker, this process, raised ``exc``: as
    :func:`describe_elastic_failure` words a worker the agent saw fail (its traceback is in
    the run's log)."""
    cause, _ = rank_error(exc)
    return f"a worker failed, so the whole run was stopped:\n  rank 0 (pid {os.getpid()}) {cause}"


def _logged_failures(log_file: str | None) -> dict[int, tuple[str, str]]:
    """``{rank: (pid, last line of its traceback)}`` for each ``[rankN] worker failed (pid
    P):`` entry that the workers wrote into the run's log."""
    try:
        text = Path(log_file).read_text(errors="replace") if log_file else ""
    except OSError:
        return {}
    found = {}
    pattern = r"^\[rank(\d+)\] worker failed \(pid (\d+)\):\n(Traceback.*?)(?=^\[|\Z)"
    for match in re.finditer(pattern, text, flags=re.S | re.M):
        tail = [line for line in match.group(3).splitlines() if line.strip()]
        if tail:
            found[int(match.group(1))] = (match.group(2), tail[-1].strip())
    return found


def _own_error(failure: Any) -> str | None:
    """The message of a ddpexp error (ConfigError, CheckpointError, ...) a rank raised."""
    data = failure.error_file_data
    message = data.get("message") if isinstance(data, dict) else None
    text = str(message.get("message", "")) if isinstance(message, dict) else ""
    name, _, rest = text.partition(": ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.DdpexpError) and rest:
        return rest
    return None


def _own_cause(line: str) -> str | None:
    """The message of a ddpexp error in a line of :func:`describe_elastic_failure` ("rank 1
    (pid 7) raised ConfigError: no space left ..."), None for any other cause."""
    _, raised, text = line.partition(" raised ")
    name, _, rest = text.partition(": ")
    cls = getattr(errors, name.rpartition(".")[2], None)
    if raised and isinstance(cls, type) and issubclass(cls, errors.DdpexpError) and rest:
        return rest
    return None


def _exit_cause(failure: Any) -> str:
    data = failure.error_file_data
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip()
        if text:
            return "raised " + text.splitlines()[-1] if "Traceback" in text else "raised " + text
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"was killed by {name}"
    return f"exited with code {failure.exitcode}"


def describe_step_failure(failed: dict[int, dict], stalled: dict[int, dict], world: int,
                          timeout_s: float, log_file: str,
                          whole: str = "the whole SLURM step", missing: Sequence[int] = (),
                          store: str = "") -> str:
    """The step's failure in one message: ranks that never joined (``missing``: the others'
    waits for them are no causes of their own), stalled ranks, then ranks with a cause of
    their own, then ranks that vanished; ranks that only lost a peer are not repeated."""
    if missing:
        lines = [f"rank {r} never joined: the others waited trainer.dist_timeout_s="
                 f"{timeout_s:g} s for it at {store or 'their store'}. Start it (RANK={r}) "
                 f"with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE={world}, or give "
                 "WORLD_SIZE the number of ranks you start" for r in missing]
        head = (f"a rank never started, so {whole} was stopped:" if len(lines) == 1 else
                f"{len(lines)} ranks never started, so {whole} was stopped:")
        return head + "\n  " + "\n  ".join(lines)
    lines = [f"rank {r} (pid {s['pid']}) stalled: no progress while the others waited "
             f"trainer.dist_timeout_s={timeout_s:g} s for it; its Python stack is in {log_file}"
             for r, s in sorted(stalled.items())]
    own = {r: f for r, f in failed.items() if r not in stalled and not _only_lost_peer(f["cause"])
           and not (f.get("timeout") and stalled)}
    lines += [f"rank {r} (pid {f['pid']}) {f['cause']}" for r, f in sorted(own.items())]
    if not lines:
        silent = [r for r in range(world) if r not in failed and r not in stalled]
        lines += [f"rank {r} died without a Python error (killed by a signal: SIGKILL from "
                  "another process, or the kernel when memory ran out)" for r in silent]
    if not lines:  # every rank only saw its peers go: say what they saw
        lines = [f"rank {r} (pid {f['pid']}) {f['cause']}" for r, f in sorted(failed.items())]
    noun = "stalled" if stalled else "failed"
    head = (f"a worker {noun}, so {whole} was stopped:" if len(lines) == 1 else
            f"{len(lines)} workers {noun}, so {whole} was stopped:")
    return head + "\n  " + "\n  ".join(lines)


def _only_lost_peer(cause: str) -> bool:
    return any(k.lower() in cause.lower() for k in PEER_LOST)


def rank_error(exc: BaseException) -> tuple[str, bool]:
    """``("raised ValueError: bad", False)``; the flag says a collective timed out."""
    text = str(exc).strip().splitlines()
    last = text[-1] if text else ""
    timed_out = "timed out" in str(exc).lower()
    if isinstance(exc, DdpexpError):
        return str(exc), timed_out
    if timed_out:
        return "timed out in a collective (waited longer than trainer.dist_timeout_s)", True
    return f"raised {type(exc).__name__}: {last}", False
