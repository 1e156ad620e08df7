"""Runs whose ranks SLURM started: ``srun --ntasks-per-node=N python -m ddpexp ...``.

Each task of the step is one rank; ddpexp spawns nothing. Only global rank 0 goes through
Hydra: it composes the config, guards and claims the run dir, writes Hydra's files and the
log's "run dir" line once, and hands the resolved config to the other tasks through a small
key-value store of the step (a ``TCPStore`` that rank 0 hosts at ``MASTER_ADDR:MASTER_PORT``,
which the process group then uses too). The other tasks never look at ``sys.argv``.

The same store carries what one task knows about a failure to the others, since SLURM itself
keeps a step alive until its last task has exited:

- a rank that raises (or whose collective breaks or times out) says so under
  ``failed/<rank>`` and raises the step's ``abort`` flag before it exits;
- every rank runs a :class:`Listener` thread: when ``abort`` is raised and its own rank has
  not failed within a grace period, the rank is stuck (a stalled ``forward``, a DataLoader
  that never returns): it writes its Python stack into the run's log, says so under
  ``stalled/<rank>`` and ends its process, so the step ends without ``srun -K1``;
- global rank 0 turns what the store holds into one message naming the ranks and their
  causes, which the run reports and records in ``metrics.json`` as ``failed``. A rank that
  died without a word (SIGKILL) is named as such; when that rank is rank 0 (the store gone
  with it), rank 1 writes the record and the message.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import re
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from ddpexp.errors import ConfigError, RunFailed, RunInterrupted
from ddpexp.launch.failures import describe_step_failure, rank_error
from ddpexp.record import record_failure

log = logging.getLogger("ddpexp")

# SLURM_STEP_ID of a batch script's own step (and its extern step): the script is one
# process, however many tasks the allocation has.
_NOT_A_STEP = 0xFFFFFFF0
# The ports derived for steps: below Linux's ephemeral range (32768-60999), from which
# connections and the OS's "any free port" come.
PORT_BASE, PORT_SPAN = 20000, 12000
# How long tasks other than rank 0 wait for rank 0 to start the store and the run.
CONNECT_TIMEOUT_S = 60.0
PAYLOAD_TIMEOUT_S = 900.0
POLL_S = 0.25
# After the abort flag, how long a rank's own code has to fail by itself (it was waiting in
# a collective that is about to break) before the rank counts as stuck.
GRACE_S = {"timeout": 2.0, "error": 10.0}
# How long global rank 0 waits for the other ranks' reports before it writes its message.
REPORT_WAIT_S = {"timeout": 8.0, "error": 3.0}
EXIT_FAILED = 1


def step_ranks() -> bool:
    """Inside an ``srun`` step of several tasks (and not under torch elastic), SLURM has
    already started every rank."""
    env = os.environ
    if "SLURM_PROCID" not in env or "TORCHELASTIC_RUN_ID" in env:
        return False
    try:
        step = int(env.get("SLURM_STEP_ID", "0"))
        return int(env.get("SLURM_NTASKS", "1")) > 1 and step < _NOT_A_STEP
    except ValueError:
        return False


def rank() -> int:
    """This task's global rank."""
    return int(os.environ["SLURM_PROCID"])


def world_size() -> int:
    """The step's tasks in all: its ranks."""
    return int(os.environ["SLURM_NTASKS"])


def tasks_per_node() -> int:
    """This step's tasks on this node (``SLURM_STEP_TASKS_PER_NODE`` reads e.g. ``2(x3)``)."""
    env = os.environ
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):
            return int(env[key].split("(")[0].split(",")[0])
    return world_size()


def nodes() -> int:
    """The step's nodes."""
    env = os.environ
    return int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        return "localhost"
    prefix, ranges = match.groups()
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def master_env() -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT of this step, which every task computes alike without talking:
    the first node of the step, and a port from the job id and the step id, so that two
    steps side by side in one allocation each get their own (either can be set instead)."""
    env = os.environ
    out = {}
    if "MASTER_ADDR" not in env:
        out["MASTER_ADDR"] = first_host(env.get("SLURM_STEP_NODELIST", env.get(
            "SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost"))))
    if "MASTER_PORT" not in env:
        job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0"))
        out["MASTER_PORT"] = str(PORT_BASE + (job * 64 + step) % PORT_SPAN)
    return out


def rank_env() -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE as torchrun sets them, so that code that
    reads them (a user's model, torch itself) sees the same world under srun."""
    env = os.environ
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(tasks_per_node())}


def sweep_problem(args: list[str]) -> Optional[str]:
    """A message when the command line of an srun task asks for a sweep: every job would be
    a run of its own on the same tasks, which one step cannot give."""
    if any(a in ("-m", "--multirun") for a in args):
        return ("a sweep (-m) cannot run inside an srun step, whose tasks are the ranks of one "
                "run: run the sweep with hydra/launcher=submitit_slurm, or one srun per run")
    return None


def quiet_torch_warnings() -> None:
    """Keep torch's C++ warnings (a rank's store connection dropping as rank 0 exits after a
    failure, with their C++ stack frames) off the terminal of every task: the step's failure
    is rank 0's one message. Errors still show; ``TORCH_CPP_LOG_LEVEL`` set by the user wins.
    Must run before torch is imported."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class Step:
    """This task's handle on the step's store (rank 0 hosts it)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.failing = threading.Event()

    @classmethod
    def connect(cls) -> "Step":
        """Host (rank 0) or join the store at this step's MASTER_ADDR:MASTER_PORT."""
        import torch.distributed as dist

        os.environ.update(master_env())
        os.environ.update(rank_env())
        me, world = rank(), world_size()
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        try:
            store = dist.TCPStore(addr, port, world, is_master=me == 0,
                                  timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                                  wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
            raise ConfigError(
                f"rank {me} of this SLURM step could not {'open' if me == 0 else 'reach'} the "
                f"step's store at {addr}:{port} ({str(exc).splitlines()[0]}). Another process may "
                "hold that port: set MASTER_PORT to a free one for the srun") from None
        step = cls(store, me, world)
        if me != 0:
            step.report("joined")
        return step

    # -------------------------------------------------------------- the run's config
    def publish(self, payload: Any) -> None:
        """Rank 0: hand the worker payload (resolved config, run dir) to the other tasks, as
        JSON: what arrives over the network is read as data, never unpickled."""
        self.store.set("payload", json.dumps(dataclasses.asdict(payload)))

    def abort(self, kind: str, message: str = "") -> None:
        """Tell every task to stop: ``kind`` is ``timeout`` (a collective waited too long),
        ``error`` (a rank failed) or ``start`` (rank 0 could not start the run)."""
        try:
            if not self.store.check(["abort"]):
                self.store.set("abort", json.dumps({"by": self.rank, "kind": kind, "message": message}))
        except Exception:  # noqa: BLE001 - the store went away with rank 0
            pass

    def reachable(self) -> bool:
        """Whether the store (rank 0's process) still answers."""
        try:
            self.store.check(["abort"])
            return True
        except Exception:  # noqa: BLE001
            return False

    def aborted(self) -> Optional[dict]:
        """The abort record (``by``, ``kind``, ``message``) if some rank raised it; a store that
        no longer answers counts as rank 0's abort."""
        try:
            if self.store.check(["abort"]):
                return json.loads(self.store.get("abort"))
        except Exception:  # noqa: BLE001
            return {"by": 0, "kind": "error", "message": "rank 0 ended"}
        return None

    def wait_payload(self) -> Optional[Any]:
        """Other ranks: rank 0's payload, or ``None`` when it aborted the start."""
        deadline = time.time() + PAYLOAD_TIMEOUT_S
        while time.time() < deadline:
            try:
                if self.store.check(["payload"]):
                    from ddpexp.launch.worker import WorkerPayload

                    return WorkerPayload(**json.loads(self.store.get("payload")))
            except Exception:  # noqa: BLE001 - rank 0 ended, and with it the store
                return None
            if self.aborted() is not None:
                return None
            time.sleep(POLL_S)
        return None

    def wait_joined(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Rank 0: wait until every other task has connected to the store."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and len(self.reports("joined")) < self.world - 1:
            time.sleep(POLL_S)

    # -------------------------------------------------------------- failures
    def report(self, section: str, **fields: Any) -> None:
        """Say under ``section/<rank>`` what happened to this rank."""
        try:
            self.store.set(f"{section}/{self.rank}", json.dumps({"pid": os.getpid(), **fields}))
        except Exception:  # noqa: BLE001
            pass

    def reports(self, section: str) -> dict[int, dict]:
        """``{rank: record}`` of the ranks that reported under ``section`` so far."""
        out = {}
        for r in range(self.world):
            try:
                if self.store.check([f"{section}/{r}"]):
                    out[r] = json.loads(self.store.get(f"{section}/{r}"))
            except Exception:  # noqa: BLE001
                break
        return out

    def failure_message(self, kind: str, timeout_s: float, log_file: str) -> str:
        """Rank 0: one message for the step's failure, once the others have reported."""
        deadline = time.time() + REPORT_WAIT_S.get(kind, 3.0)
        while time.time() < deadline:
            heard = set(self.reports("failed")) | set(self.reports("stalled"))
            if len(heard) >= self.world:
                break
            time.sleep(POLL_S)
        failed, stalled = self.reports("failed"), self.reports("stalled")
        return describe_step_failure(failed, stalled, self.world, timeout_s, log_file)


class Listener:
    """A daemon thread per rank that ends a stuck rank once the step is aborted (see the
    module's docstring). ``on_stuck`` runs before the process ends (rank 0 records the
    failure there)."""

    def __init__(self, step: Step, log_file: str,
                 on_stuck: Optional[Callable[[str], None]] = None) -> None:
        self.step, self.log_file, self.on_stuck = step, log_file, on_stuck
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="ddpexp-slurm", daemon=True)

    def __enter__(self) -> "Listener":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _listen(self) -> None:
        while not self._done.wait(POLL_S * 2):
            abort = self.step.aborted()
            if abort is None or abort.get("by") == self.step.rank:
                continue
            kind = abort.get("kind", "error")
            if self._done.wait(GRACE_S.get(kind, 2.0)) or self.step.failing.is_set():
                return  # this rank's own code saw the failure and handles it
            self._end_stuck(kind)

    def _end_stuck(self, kind: str) -> None:
        self._dump_stack()
        if kind == "timeout":
            self.step.report("stalled")
        else:
            self.step.report("failed", cause="was stopped: it did not notice the other ranks' "
                                             "failure (stuck outside a collective)")
        if self.on_stuck is not None:
            try:
                self.on_stuck(kind)
            except Exception:  # noqa: BLE001 - the process ends either way
                pass
        logging.shutdown()
        os._exit(EXIT_FAILED)

    def _dump_stack(self) -> None:
        try:
            with open(self.log_file, "a") as f:
                f.write(f"[rank{self.step.rank}] stalled while the other ranks of the SLURM step "
                        "waited for it; its Python stack (most recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass


# The step's store outlives the calls that use it: ``__main__`` opens it before Hydra runs
# (so that a start that fails can still tell the other tasks), the launch publishes the
# config through it. A process belongs to one step at most: one handle per process.
_STEP: list[Step] = []


def current() -> Step:
    """This process's handle on its step's store, opened on first use."""
    if not _STEP:
        _STEP.append(Step.connect())
    return _STEP[0]


# ------------------------------------------------------------------------------ tasks
def lead(step: Step, main: Callable[[], Any]) -> None:
    """Global rank 0: run ``main`` (Hydra's, which reaches :func:`run_rank` through the
    launch), and abort the step's start if it ends without having published the config."""
    try:
        main()
    finally:
        try:
            published = step.store.check(["payload"])
        except Exception:  # noqa: BLE001
            published = True
        if not published:
            step.abort("start")
            # The store ends with this process: the other tasks must have read the abort
            # first, or they would wait for a store that is gone.
            step.wait_joined()


def follow(step: Step) -> int:
    """A task other than rank 0: wait for rank 0's config and run as this rank. Returns the
    exit status; a failure is reported by rank 0, so this task prints nothing of it."""
    payload = step.wait_payload()
    if payload is None:
        return EXIT_FAILED  # rank 0 said why (a bad override, a run dir already taken)
    try:
        run_rank(step, payload)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_FAILED
    except BaseException:  # noqa: BLE001 - reported through the store and the log
        return EXIT_FAILED
    return 0


def run_rank(step: Step, payload: Any) -> Optional[dict]:
    """Run the worker as this task's rank; a failure is reported to the step, and on global
    rank 0 it becomes one :class:`RunFailed` naming the ranks at fault."""
    from ddpexp.launch.worker import run_worker  # torch and the trainer: only where a rank runs

    timeout_s = float(payload.config["trainer"]["dist_timeout_s"])
    started = time.time()
    on_stuck = _record_stuck(step, payload, timeout_s, started) if step.rank == 0 else None
    with Listener(step, payload.log_file, on_stuck):
        try:
            return run_worker.__wrapped__(payload, store=step.store)
        except RunInterrupted:
            raise
        except BaseException as exc:
            step.failing.set()
            cause, timed_out = rank_error(exc)
            abort = step.aborted()
            kind = "timeout" if timed_out or (abort or {}).get("kind") == "timeout" else "error"
            step.report("failed", cause=cause, timeout=timed_out)
            step.abort(kind)
            if step.rank == 1 and not step.reachable():
                # Rank 0 is gone, and with it the store and the run's writer: the next rank
                # says what it saw, once.
                seen = {r: {"pid": os.getpid(), "cause": cause} for r in range(1, step.world)}
                _tell(payload, describe_step_failure(seen, {}, step.world, timeout_s, payload.log_file),
                      started)
            if step.rank != 0:
                raise
            raise RunFailed(step.failure_message(kind, timeout_s, payload.log_file)) from None


def _record_stuck(step: Step, payload: Any, timeout_s: float,
                  started: float) -> Callable[[str], None]:
    """What global rank 0 does when it is the stuck rank: the record and the message that its
    own failure path would have written (the wall time counted from ``started``)."""
    def record(kind: str) -> None:
        _tell(payload, step.failure_message(kind, timeout_s, payload.log_file), started)

    return record


def _tell(payload: Any, message: str, started: float) -> None:
    """The step's failure from a rank other than the usual writer's path: ``metrics.json``
    marked ``failed``, the message in the run's log and, once, on the terminal."""
    record_failure(Path(payload.run_dir), RunFailed(message), started)
    try:
        with open(payload.log_file, "a") as f:
            f.write(message + "\n")
    except OSError:
        pass
    print(message, file=sys.stderr, flush=True)
