"""Sweep jobs forked from a process that has already imported torch, Hydra and ddpexp.

A fresh interpreter spends seconds importing torch, Hydra, ddpexp and what a run imports on
its way (TensorBoard, torch's compiler stack, which its optimizers load): a sweep of short
jobs paid that once per job. The ddp launcher instead has one server process (``python -m
ddpexp.sweep.forkserver``) for the sweep, started by the command itself before Hydra's
import where the command line is such a sweep (:func:`start_early`), else by the launcher; it
imports all of that once and then only forks (for a sweep of another app, only Hydra and the
modules ``hydra.launcher.preload`` names: that app's jobs import what they need themselves).
Each forked child is a job process as ``python -m ddpexp.sweep.job`` would be: it puts itself
in a process group of its own, takes the launcher's environment for the job (its GPUs, thread
counts), resets the signal handlers and runs :func:`ddpexp.sweep.job.main`, which sets the
job's CPU affinity, and the worker its thread count, before any tensor op.

Beyond importing, the server does once what each job's Hydra set-up would do first:
it discovers Hydra's plugins and parses a few overrides (pure Python, which builds the
override grammar's tables), so that a forked job pays for neither. A child's end wakes its
loop at once (SIGCHLD), and the launcher waits on the exit it is told, not on a poll: the
slot it frees is given to the next job as the last one ends.

What makes the fork safe: the server runs no tensor op, queries no device, and starts no
thread. Before every fork it checks that it has one Python thread and no more native
threads than it had right after its imports (the thread pools that numpy's and SciPy's
BLAS start when they load, which the BLAS libraries themselves re-create in a forked
child); where that does not hold, or the server cannot start, the launcher starts that job,
and the rest, in a fresh interpreter, with one warning.

The launcher and the server talk over two pipes, one JSON object per line: the launcher
sends ``{"id", "spec", "result", "env", "cwd"}`` (and ``"call"``, another entry point than
the job's), the server answers ``{"id", "pid"}`` or
``{"id", "error"}``, and ``{"exit": pid, "code": c}`` when a child ends (``code`` as
``Popen.returncode`` gives it: negative for a signal). The server ends when the launcher's
end of its pipe closes.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("hydra_plugins.ddpexp_launcher")

# What every job imports on its way to its task function, imported once in the server.
BASE = ("hydra", "cloudpickle", "ddpexp.sweep.job")
# What a ddpexp run imports on its way to the first step: preloaded for sweeps of ddpexp's
# own app (another app's jobs, Hydra's test apps among them, need not pay for torch).
PRELOAD = (
    "torch",
    "torch._dynamo",  # torch's optimizers import it when they are built
    "torch.utils.tensorboard",
    "ddpexp.launch.fanout",
    "ddpexp.launch.worker",
    "ddpexp.training.trainer",
    "ddpexp.data.sources",
    "ddpexp.loggers",
    "ddpexp.modes.train",
    "ddpexp.training.build",
    "ddpexp.strategies.blocks",
    "ddpexp.report.rows",
    "hydra._internal.logging_config",
    # What TensorBoard's hparams summary and a checkpoint's save import on first use.
    "tensorboard.plugins.hparams.api_pb2",
    "tensorboard.plugins.hparams.metadata",
    "torch.utils.serialization",
    "numpy.ma",
    "resource",
)
# The argument that tells the server to import BASE and the caller's modules only.
LIGHT = "--light"
# How long a sweep waits at its start for the server's imports before its jobs start afresh.
READY_TIMEOUT_S = 120.0
# In a forked job process: the pid of the server it was forked from (None elsewhere).
FORKED_FROM: int | None = None


def native_threads() -> int:
    """This process's threads, as the kernel counts them (Python's and native ones)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# ------------------------------------------------------------------------------ server
def serve(requests: int, replies: int, preload: Sequence[str]) -> int:
    """The server's loop: import, say ready, then fork a job for every request and report
    every child's exit, until the launcher closes ``requests``."""
    import importlib

    # Ctrl-C in the terminal reaches the launcher, which stops the jobs; the server ends
    # when the launcher does (its pipe closes), not on the terminal's signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.fdopen(replies, "w", buffering=1)

    def say(message: dict) -> None:
        out.write(json.dumps(message) + "\n")

    light = LIGHT in preload
    modules = [*BASE, *([] if light else PRELOAD), *(m for m in preload if m != LIGHT)]
    what = "starting"
    try:
        for name in modules:
            what = f"importing {name}"
            importlib.import_module(name)
        what = "discovering Hydra's plugins and parsing overrides"
        _warm()
    except Exception as exc:
        say({"failed": f"{what} raised {type(exc).__name__}: {exc}"})
        return 1
    baseline = native_threads()
    # A child's end wakes the loop at once (its exit is what frees the launcher's slot).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    say({"ready": os.getpid(), "threads": baseline})
    pending = b""
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(say)
        if requests not in ready:
            continue
        data = os.read(requests, 1 << 16)
        if not data:
            return 0
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            why = _unsafe(baseline)
            if why:
                say({"id": request["id"], "error": why})
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                _child(request, requests, out)
            # The child does the same: whichever runs first, the group exists before the
            # launcher can signal it.
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child has ended already
            say({"id": request["id"], "pid": pid})


def _warm() -> None:
    """What every job's Hydra set-up would do first, done once here: discover Hydra's
    plugins (their modules imported; a child whose import path is the server's keeps the
    result, :func:`ddpexp.sweep.job.restore_hydra`) and parse overrides once, which builds
    the override grammar's tables (the first parse in a process costs tens of ms)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.plugins import Plugins

    Plugins.instance()
    schema = sys.modules.get("ddpexp.config.schema")  # a ddpexp run's typed trainer (5 ms)
    if schema is not None:
        schema.trainer_schema()
    OverridesParser.create().parse_overrides(
        ["seed=0", "optimizer.lr=0.001", "data.batch_size=32", "trainer.test=false",
         "model=convnet", "+callbacks.a_b._target_=pkg.mod.Cls", "~c",
         "hydra.sweep.dir=/tmp/Ab_c-9/2026-01-01_00-00-00", "e=[1,2.5e-3]", "f={g:h}",
         "i=choice(1,2)", "j=null", "k='l m'", 'l="m n"', "m=${n.o}"])


def _unsafe(baseline: int) -> str | None:
    """Why forking now is not safe, or None."""
    if threading.active_count() != 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"the fork server has Python threads besides its main one ({names})"
    now = native_threads()
    if now > baseline:
        return (f"the fork server has {now} threads, {now - baseline} more than after its "
                "imports")
    return None


def _reap(say: Any) -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(request: dict, requests: int, out: Any) -> None:
    """The forked job process: its own process group, the job's environment and signal
    handlers, then the job. Never returns."""
    global FORKED_FROM
    code = 1
    try:
        FORKED_FROM = os.getppid()
        os.setpgid(0, 0)
        os.close(requests)
        out.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        call = request.get("call")
        if call:  # another entry point than a job's, e.g. a rank of a job over nodes
            import importlib

            module, _, name = call.partition(":")
            sys.argv = [module]
            code = getattr(importlib.import_module(module), name)()
        else:
            sys.argv = ["ddpexp.sweep.job", request["spec"], request["result"]]
            from ddpexp.sweep import job

            code = job.main(request["spec"], request["result"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ------------------------------------------------------------------------------ launcher side
class ForkedJob:
    """A job process forked by the server, with the part of ``subprocess.Popen``'s interface
    the launcher uses (``pid``, ``poll()``, ``returncode``)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode


class ForkServer:
    """The launcher's handle on the server: :meth:`spawn` asks it for a job process. A
    server that cannot start, or that refuses a fork, makes :meth:`spawn` return None from
    then on (the job starts in a fresh interpreter), after one warning."""

    def __init__(self, preload: Sequence[str] = (), torch: bool = True) -> None:
        """``preload``: modules the server imports besides :data:`BASE`; ``torch``: import
        :data:`PRELOAD` (torch and ddpexp's run) too."""
        self.preload = list(preload) + ([] if torch else [LIGHT])
        self.proc: subprocess.Popen | None = None
        self.broken: str | None = None
        self._to_server: int | None = None
        self._lock = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self.exits_told = 0  # how many child exits the server has reported
        self._ready: dict | None = None
        self._next_id = 0
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start the server; its imports run while the launcher prepares the jobs."""
        if not hasattr(os, "fork"):
            self._give_up("this platform has no fork()")
            return
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddpexp.sweep.forkserver", str(req_r), str(rep_w),
                 *self.preload],
                pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL)
        except OSError as exc:
            os.close(req_w)
            os.close(rep_r)
            self._give_up(f"the fork server did not start ({exc})")
            return
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._to_server = req_w
        self._reader = threading.Thread(target=self._read, args=(rep_r,),
                                        name="ddpexp-forkserver", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the server has imported (the sweep's first jobs then fork too rather
        than each importing alongside it); past ``timeout``, jobs start afresh."""
        if self.broken is not None or self._to_server is None:
            return
        with self._lock:
            ready = self._lock.wait_for(lambda: self._ready is not None, timeout)
            message = self._ready
        if not ready:
            self._give_up(f"the fork server was not ready after {timeout:.0f} s")
        elif message is not None and "failed" in message:
            self._give_up(message["failed"])

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as replies:
            for line in replies:
                message = json.loads(line)
                with self._lock:
                    if "exit" in message:
                        self._exits[message["exit"]] = message["code"]
                        self.exits_told += 1
                    elif "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self._ready = message
                    self._lock.notify_all()
        with self._lock:
            self._ready = self._ready or {"failed": "the fork server ended before it was ready"}
            if self.broken is None and self._ready.get("ready"):
                self.broken = "the fork server ended"
            self._lock.notify_all()

    def _give_up(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            log.warning("ddp launcher: jobs start in a fresh interpreter each: %s", why)

    def spawn(self, spec: Path, result: Path, env: dict[str, str],
              call: str | None = None) -> ForkedJob | None:
        """A forked job process running ``spec``, or None when the job must start in a
        fresh interpreter instead. ``call`` (``module:function``, of a module the server
        imported) runs that function, which returns the exit code, instead of the job."""
        if self.broken is not None or self._to_server is None:
            return None
        with self._lock:
            if self._ready is None or "failed" in self._ready:
                return None  # not ready (wait_ready gave up): a fresh interpreter
            self._next_id += 1
            request_id = self._next_id
        request = {"id": request_id, "spec": str(spec), "result": str(result), "env": env,
                   "cwd": os.getcwd(), **({"call": call} if call else {})}
        try:
            os.write(self._to_server, (json.dumps(request) + "\n").encode())
        except OSError as exc:
            self._give_up(f"the fork server cannot be reached ({exc})")
            return None
        with self._lock:
            self._lock.wait_for(lambda: request_id in self._replies or self.broken is not None)
            reply = self._replies.pop(request_id, None)
        if reply is None or "pid" not in reply:
            self._give_up(reply["error"] if reply else str(self.broken))
            return None
        return ForkedJob(self, reply["pid"])

    def wait_exit(self, told: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a child's exit reported after the first ``told``
        (:attr:`exits_told` as the caller last read it). A server that ended reports no more:
        the wait then lasts ``timeout``, and the caller's poll finds its orphans' ends."""
        with self._lock:
            self._lock.wait_for(lambda: self.exits_told != told, timeout)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of forked job ``pid`` once it has ended (None while it runs). A
        server that died first leaves its children unreported: they are gone with it, or
        orphaned, and the launcher kills their group either way."""
        # Here, not at the top: the server process imports this module and nothing of Hydra.
        from ddpexp.config.runlock import pid_runs

        with self._lock:
            if pid in self._exits:
                return self._exits.pop(pid)
        if self.proc is not None and self.proc.poll() is not None and not pid_runs(pid):
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        """End the server (it exits when its pipe closes)."""
        if self._to_server is not None:
            try:
                os.close(self._to_server)
            except OSError:
                pass
            self._to_server = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def discard(self) -> None:
        """End a server no sweep took (:func:`start_early`'s, when the command turned out
        not to need it): at once, without waiting for its imports."""
        if self._to_server is not None:
            os.close(self._to_server)
            self._to_server = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------ early start
# The server :func:`start_early` started for the command's sweep, until a sweep takes it.
_EARLY: ForkServer | None = None
# The flags that print instead of running, another primary config (which may pick another
# launcher, turn forking off or preload modules), and modules of the user's own to preload.
_NOT_FORKING_EARLY = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i",
                      "--shell-completion", "-sc", "--config-name", "-cn",
                      "hydra.launcher.preload"}


def forks_early(argv: Sequence[str]) -> bool:
    """Whether a command line is a sweep that may fork ddpexp's jobs from the default server
    (the ddp launcher, forking on, no modules of the user's own to preload)."""
    args = list(argv)
    if not {"-m", "--multirun"} & set(args):
        return False
    for arg in args:
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if (key in _NOT_FORKING_EARLY or (key == "hydra/launcher" and value != "ddp")
                or (key == "hydra.launcher.fork" and value.lower() != "true")):
            return False
    return True


def start_early(argv: Sequence[str]) -> None:
    """Start the fork server of a ``python -m ddpexp -m ...`` sweep as the command starts, so
    that its imports (torch's take seconds) run while Hydra imports and composes the sweep
    on the other core. A command that may not sweep through ddpexp's forking launcher
    (:func:`forks_early`) starts none; one that turns out not to is ended by
    :func:`discard_early`."""
    global _EARLY
    if _EARLY is None and forks_early(argv):
        _EARLY = ForkServer()
        _EARLY.start()


def adopt_early(preload: Sequence[str], torch: bool) -> ForkServer | None:
    """The server :func:`start_early` started, for a sweep whose server imports what that
    one does (torch and ddpexp's run, nothing else); None (and that server ended) otherwise."""
    global _EARLY
    server, _EARLY = _EARLY, None
    if server is not None and (list(preload) or not torch):
        server.discard()
        return None
    return server


def discard_early() -> None:
    """End the early server if no sweep took it."""
    global _EARLY
    server, _EARLY = _EARLY, None
    if server is not None:
        server.discard()


def main(argv: list[str]) -> int:
    return serve(int(argv[0]), int(argv[1]), argv[2:])


if __name__ == "__main__":
    # Served from the module under its own name, not as __main__, so that a forked job
    # finds FORKED_FROM where it looks for it.
    from ddpexp.sweep.forkserver import main as _serve

    code = _serve(sys.argv[1:])
    # Nothing is left to write: skip the interpreter teardown, which takes a second or two
    # once torch is loaded and which the sweep would wait for at its end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
