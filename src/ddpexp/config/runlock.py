"""The run-dir lock: ``<run dir>/.lock`` exists while a run is live, so that one run at a
time writes into a run dir.

The lock belongs to the process that runs Hydra for the run, and it takes the lock before
the run writes anything into the dir (:func:`ddpexp.config.rundir.claimed_subdir`, which
Hydra resolves right before it saves the job's config): ddpexp's launching process (its
workers are its children), global rank 0's process in a world that torchrun, mpirun, srun
or env:// started, and each sweep job's own process. The file is created with
``O_CREAT|O_EXCL`` and holds JSON: host, pid, start time. A thread refreshes its mtime every
:data:`REFRESH_S` while the run is live; the holder removes it when the run ends, whichever
way it ends.

A lock whose holder is gone is taken over, with one warning: on this host when its pid no
longer runs (or now belongs to another process); from another host when it has not been
refreshed for :data:`STALE_AFTER_S`; from an earlier round of the same SLURM job or torch
elastic run (a requeue, a restart) at once. Processes that share a run dir by design (the
nodes of one ``trainer.nodes>1`` run, which name the same rendezvous) share the lock.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from ddpexp.errors import RunDirBusy

log = logging.getLogger("ddpexp")

LOCK_FILE = ".lock"
# How often a live run touches its lock, and how long a lock from another host may go
# untouched before it counts as abandoned: ten missed refreshes, well past the 60 s an NFS
# client may cache a file's attributes, so that a live run on another node is never taken over.
REFRESH_S = 30.0
STALE_AFTER_S = 300.0
# A lock file that is empty or unreadable is being written (O_EXCL creates it before its
# content is in) for this long, then counts as abandoned.
WRITING_S = 10.0


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what ``.lock`` holds."""

    host: str
    pid: int
    start: str  # ISO 8601, UTC
    # The pid's start time in clock ticks since boot (/proc): tells a reused pid apart.
    pid_start: int | None = None
    # The SLURM job or torch elastic run this process is a round of, and the round: a later
    # round of the same job (a requeue, a restart) supersedes an earlier one's lock.
    job: str | None = None
    round: int = 0
    # Processes that name the same ``shared_by`` share the lock (the nodes of one run).
    shared_by: str | None = None

    @classmethod
    def this_process(cls, shared_by: str | None = None) -> Holder:
        job, round_ = _job_round()
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   start=datetime.now(UTC).isoformat(timespec="seconds"),
                   pid_start=_pid_start(os.getpid()), job=job, round=round_,
                   shared_by=shared_by)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder ``text`` describes, or None for an empty or unreadable lock."""
        try:
            data = json.loads(text)
            return cls(host=str(data["host"]), pid=int(data["pid"]), start=str(data["start"]),
                       pid_start=data.get("pid_start"), job=data.get("job"),
                       round=int(data.get("round") or 0), shared_by=data.get("shared_by"))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        """``pid 4242 on host node3, since 2026-12-03 08:40:12 UTC``."""
        since = self.start.replace("T", " ").replace("+00:00", " UTC")
        return f"pid {self.pid} on host {self.host}, since {since}"


def _job_round() -> tuple[str | None, int]:
    env = os.environ
    for job_key, round_key in (("SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
                               ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")):
        if env.get(job_key):
            try:
                return f"{job_key}={env[job_key]}", int(env.get(round_key) or 0)
            except ValueError:
                return f"{job_key}={env[job_key]}", 0
    return None, 0


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _pid_start(pid: int) -> int | None:
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 of stat: starttime
    except (IndexError, ValueError):
        return None


def pid_runs(pid: int, pid_start: int | None = None) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not), and is the one that
    started at ``pid_start`` where that is known."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: the signal said it exists
    if fields[0] in ("Z", "X"):
        return False
    return pid_start is None or _pid_start(pid) in (None, pid_start)


def abandoned(holder: Holder | None, age_s: float, me: Holder | None = None) -> str | None:
    """Why a lock held by ``holder`` (None: empty or unreadable) and last refreshed
    ``age_s`` ago is abandoned, or None while it may be live. ``me``: the process asking."""
    me = me or Holder.this_process()
    if holder is None:
        return f"it is unreadable and {age_s:.0f} s old" if age_s > WRITING_S else None
    if holder.job is not None and holder.job == me.job and holder.round < me.round:
        return f"it is from round {holder.round} of {holder.job}, this is round {me.round}"
    if holder.host == me.host:
        if holder.pid == me.pid and holder.pid_start == me.pid_start:
            return None  # this very process
        return None if pid_runs(holder.pid, holder.pid_start) else "that process is gone"
    if age_s > STALE_AFTER_S:
        return (f"it was not refreshed for {age_s:.0f} s (a live run refreshes it every "
                f"{REFRESH_S:.0f} s; abandoned after {STALE_AFTER_S:.0f} s)")
    return None


def busy_message(run_dir: Path | str, holder: Holder | None) -> str:
    """The refusal of a second process: which run holds the dir, and what to do."""
    who = holder.describe() if holder is not None else "a process that is taking it now"
    lock = Path(run_dir) / LOCK_FILE
    return (f"run dir {run_dir} is in use by a live run ({who}; its lock is {lock}). One "
            "run at a time writes a run dir: wait for that run to end or stop it, then run "
            "this again (a lock whose process is gone is taken over by itself), or pick "
            "another run dir")


def _read(path: Path) -> tuple[str, float] | None:
    """The lock's text and its age in seconds, or None if there is no lock."""
    try:
        text = path.read_text()
        return text, time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def busy(run_dir: Path | str, shared_by: str | None = None) -> str | None:
    """The refusal (:func:`busy_message`) while a live run holds ``run_dir``; None when
    none does (no lock, an abandoned one, or one that ``shared_by`` shares)."""
    found = _read(Path(run_dir) / LOCK_FILE)
    if found is None:
        return None
    holder = Holder.parse(found[0])
    if holder is not None and shared_by is not None and holder.shared_by == shared_by:
        return None
    if abandoned(holder, found[1]) is not None:
        return None
    return busy_message(run_dir, holder)


class RunLock:
    """A lock this process holds (``owned``), or shares with the process that does."""

    def __init__(self, path: Path, holder: Holder, text: str, owned: bool = True) -> None:
        self.path, self.holder, self.text, self.owned = path, holder, text, owned
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if owned:
            self._thread = threading.Thread(target=self._refresh, name="ddpexp-run-dir-lock",
                                            daemon=True)
            self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return  # removed under the run (by hand): nothing left to refresh

    def release(self) -> None:
        """Remove the lock file if it is still this process's own."""
        self._stop.set()
        if not self.owned or os.getpid() != self.holder.pid:
            return  # a forked child, or the nodes that share the owner's lock
        try:
            if self.path.read_text() == self.text:
                self.path.unlink()
        except OSError:
            pass  # gone already (the dir of a run refused before its first step, removed)


def acquire(run_dir: Path | str, shared_by: str | None = None) -> RunLock:
    """Take ``run_dir``'s lock for this process; an abandoned one is taken over with one
    warning. Raises :class:`~ddpexp.errors.RunDirBusy` while a live run holds it."""
    path = Path(run_dir) / LOCK_FILE
    me = Holder.this_process(shared_by)
    text = json.dumps(asdict(me), indent=1) + "\n"
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return RunLock(path, me, text)
        found = _read(path)
        if found is None:
            continue  # released meanwhile
        holder = Holder.parse(found[0])
        if holder is not None and shared_by is not None and holder.shared_by == shared_by:
            return RunLock(path, holder, found[0], owned=False)
        why = abandoned(holder, found[1], me)
        if why is None:
            raise RunDirBusy(busy_message(run_dir, holder))
        if _take_over(path, found[0]):
            who = holder.describe() if holder is not None else "an unknown process"
            log.warning("taking over the lock of run dir %s from %s: %s", run_dir, who, why)
    raise RunDirBusy(busy_message(run_dir, None))


def _take_over(path: Path, stale: str) -> bool:
    """Remove the abandoned lock whose text is ``stale``, unless another process replaced
    it meanwhile: renaming is atomic, so of several processes taking it over one removes it,
    and a fresh lock renamed by mistake is put back."""
    aside = path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        if aside.read_text() == stale:
            return True
        os.link(aside, path)  # put back, unless a lock exists again
        return False
    except OSError:
        return False
    finally:
        aside.unlink(missing_ok=True)


# The locks this process holds, by run dir, and the dirs it was refused: the resolver that
# takes a lock and the task function that reports a refusal run at different moments of one
# Hydra job, and must agree.
_HELD: dict[str, RunLock] = {}
_REFUSED: dict[str, RunDirBusy] = {}


def claim(run_dir: Path | str, shared_by: str | None = None) -> RunLock:
    """:func:`acquire` once per run dir and process: the lock held already, or the refusal
    already met (raised again)."""
    key = str(Path(run_dir).absolute())
    if key in _REFUSED:
        raise _REFUSED[key]
    if key not in _HELD:
        try:
            lock = acquire(key, shared_by)
        except RunDirBusy as exc:
            _REFUSED[key] = exc
            raise
        if not _HELD:
            atexit.register(release_all)  # a process that ends before its run's finally
        _HELD[key] = lock
    return _HELD[key]


def refusal(run_dir: Path | str) -> RunDirBusy | None:
    """The refusal this process met claiming ``run_dir``, if any."""
    return _REFUSED.get(str(Path(run_dir).absolute()))


def release(run_dir: Path | str) -> None:
    """The run in ``run_dir`` ended: remove its lock, forget a refusal."""
    key = str(Path(run_dir).absolute())
    _REFUSED.pop(key, None)
    lock = _HELD.pop(key, None)
    if lock is not None:
        lock.release()


def release_all() -> None:
    """Remove every lock this process still holds."""
    for key in list(_HELD):
        release(key)
