"""Runs whose ranks another launcher started: ``torchrun``, ``mpirun``, ``srun``, or the
env:// variables of a Kubernetes PyTorchJob (:mod:`ddpexp.launch.world` tells which).

Each process is one rank; ddpexp spawns nothing. Only global rank 0 goes through Hydra: it
composes the config, guards and claims the run dir, writes Hydra's files and the log's "run
dir" line once, and hands the resolved config to the other ranks through a small key-value
store they share (a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, hosted by rank 0, or by
torchrun's agent, which rank 0 then joins as a client), which the process group then uses too.
The other ranks never look at ``sys.argv``. Under torchrun, rank 0 also leaves the run dir in
the agent's store, where the next round of a restart finds it and continues from ``last.pt``.

The same store carries what one rank knows about a failure to the others, since a launcher
may keep the others alive (SLURM keeps a step alive until its last task has exited):

- a rank that raises (or whose collective breaks or times out) says so under
  ``failed/<rank>`` and raises the ``abort`` flag before it exits;
- every rank runs a :class:`Listener` thread: when ``abort`` is raised and its own rank has
  not failed within a grace period, the rank is stuck (a stalled ``forward``, a DataLoader
  that never returns): it writes its Python stack into the run's log, says so under
  ``stalled/<rank>`` and ends its process, so the launch ends without ``srun -K1``;
- global rank 0 turns what the store holds into one message naming the ranks and their
  causes, which the run reports and records in ``metrics.json`` as ``failed``. A rank that
  died without a word (SIGKILL) is named as such; when that rank is rank 0 (the store gone
  with it), rank 1 writes the record and the message. A rank that never joined the store is
  named as the cause, once the others' wait for it (``trainer.dist_timeout_s``) ends;
- under torchrun agents on several nodes the ranks of a failed run end together, once rank 0
  has told the failure (:data:`LEAVE_S`): an agent whose worker ended early would take the
  rendezvous store it may host with it, and the other agents would crash on their terminals;
- a rank whose output is seen apart from rank 0's (an env:// pod, another node's torchrun
  agent) prints one line saying where the run's log is, and then its own error, if any.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddpexp.config import runlock
from ddpexp.errors import ConfigError, RunFailed, RunInterrupted
from ddpexp.launch.failures import describe_step_failure, rank_error
from ddpexp.launch.world import World, detect
from ddpexp.record import record_failure

if TYPE_CHECKING:
    from ddpexp.config.spec import RunSpec

log = logging.getLogger("ddpexp")

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
# A failed run of torchrun agents on several nodes: every rank ends this long after rank 0
# has told the run's failure, so that every agent sees its worker fail in the same monitor
# tick (0.1 s), before any of them leaves. An agent that leaves early takes the rendezvous
# store it may host with it, and the agents still waiting on their workers then crash with
# some 80 lines of TCPStore stack on their terminal.
LEAVE_S = 1.0
# How long a failed rank waits for rank 0 to say when to leave: its report wait, and more.
LEAVE_WAIT_S = 30.0
# Where the ranks leave together, how long after the abort a rank waiting in a collective
# counts as waiting for the failed rank (whose sockets stay open until then).
LEAVE_GRACE_S = 2.0


def sweep_problem(args: list[str], world: World) -> str | None:
    """A message when the command line of a rank asks for a sweep: every job would be a run
    of its own on the same ranks, which one launch of them cannot give."""
    if any(a in ("-m", "--multirun") for a in args):
        if world.launcher == "slurm":
            return ("a sweep (-m) cannot run inside an srun step, whose tasks are the ranks of "
                    "one run: run the sweep with hydra/launcher=submitit_slurm, or one srun per run")
        return (f"a sweep (-m) cannot run on {world.what}, which are the ranks of one run: start "
                "the sweep with python -m ddpexp -m ... (each job fans out its own workers), or "
                "one launch per run")
    return None


def fanout_keys_problem(args: list[str], world: World) -> str | None:
    """A message when the command line sets a key of ddpexp's own fan-out that the launcher
    decides instead: restarts (``trainer.max_restarts``), the number of nodes
    (``trainer.nodes``, :func:`nodes_problem`) and the nodes' rendezvous
    (``trainer.rdzv_endpoint``)."""
    from ddpexp.config.commands import SWEPT, command_line_values

    values = command_line_values(args)
    restarts = values.get("trainer.max_restarts")
    if restarts not in (None, 0, SWEPT):
        hint = ("torchrun --max-restarts=N" if world.launcher == "torchrun" else
                "the launcher's own restarts (and resume=auto with a fixed hydra.run.dir)")
        return (f"trainer.max_restarts={restarts} restarts ddpexp's own workers, but "
                f"{world.what} were started by another launcher: use {hint}")
    nodes = values.get("trainer.nodes")
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        problem = nodes_problem(nodes, world)
        if problem:
            return problem
    if values.get("trainer.rdzv_endpoint") not in (None, ""):
        return (f"trainer.rdzv_endpoint is the rendezvous of ddpexp's own nodes, but "
                f"{world.what} meet at {world.master_addr}:{world.master_port}, which the "
                "launcher chose: leave trainer.rdzv_endpoint unset")
    return None


def nodes_problem(nodes: int, world: World) -> str | None:
    """A message when ``trainer.nodes`` asks for another number of nodes than ``world``
    spans: the launcher decides the nodes (torchrun by its ``--nnodes``), and the message
    says how to ask it for ``nodes``. None where they agree (or ``nodes`` is the default 1)."""
    if nodes == 1 or nodes == world.nodes:
        return None
    start = {
        "torchrun": f"torchrun --nnodes={nodes} --rdzv-endpoint=HOST:PORT ... on each of the "
                    f"{nodes} nodes (torchrun's --nnodes is the number of nodes)",
        "slurm": f"srun --nodes={nodes} ... (the SLURM step's nodes are the run's)",
        "mpi": f"mpirun with {nodes} hosts (--host or --hostfile; the MPI job's hosts are the "
               "run's nodes)",
        "env": f"{nodes} nodes' ranks (WORLD_SIZE counts the ranks of every node)",
    }[world.launcher]
    return (f"trainer.nodes={nodes}, but {world.what} span {world.nodes} node(s): the launcher "
            f"decides the nodes, not trainer.nodes. Leave trainer.nodes unset (and "
            f"trainer.rdzv_endpoint: both are for ddpexp's own fan-out), and for {nodes} nodes "
            f"start {start}")


def quiet_torch_warnings() -> None:
    """Keep torch's C++ warnings (a rank's store connection dropping as rank 0 exits after a
    failure, with their C++ stack frames) off the terminal of every task: the step's failure
    is rank 0's one message. Errors still show; ``TORCH_CPP_LOG_LEVEL`` set by the user wins.
    Must run before torch is imported."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class Step:
    """This rank's handle on the store its world meets in (rank 0, or torchrun's agent, hosts it)."""

    def __init__(self, store: Any, world: World, raw: Any = None) -> None:
        self.store, self.world_info, self.raw = store, world, raw if raw is not None else store
        self.rank, self.world = world.rank, world.world_size
        self.failing = threading.Event()

    @classmethod
    def connect(cls, world: World) -> Step:
        """Host (rank 0) or join the store the ranks of ``world`` meet in. torchrun's agent
        hosts one already: every rank joins it, and the keys of each restart round are kept
        apart (``raw`` keeps what outlives a round: the run dir)."""
        import torch.distributed as dist

        os.environ.update(world.env())
        me, size = world.rank, world.world_size
        addr, port = world.master_addr, world.master_port
        hosts = me == 0 and not world.agent_store
        try:
            raw = dist.TCPStore(addr, port, size, is_master=hosts,
                                timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                                wait_for_workers=False)
        except Exception as exc:
            fix = ("Another process may hold that port: set MASTER_PORT to a free one for "
                   "every rank") if hosts else (
                f"It is hosted by {'the launcher' if world.agent_store else 'rank 0'}: is that "
                f"running, on MASTER_ADDR={addr}? Every rank needs the same MASTER_ADDR and "
                "MASTER_PORT")
            raise ConfigError(
                f"rank {me} of {world.what} could not {'open' if hosts else 'reach'} their "
                f"store at {addr}:{port} ({str(exc).splitlines()[0]}). {fix}") from None
        store = raw
        if world.launcher == "torchrun":
            store = dist.PrefixStore(f"ddpexp/{world.run_id}/round-{world.restart}", raw)
            raw = dist.PrefixStore(f"ddpexp/{world.run_id}", raw)
        step = cls(store, world, raw)
        if me != 0:
            step.report("joined", host=socket.gethostname())
        return step

    def remember_run_dir(self, run_dir: str) -> None:
        """Rank 0: keep the run dir where a later restart round of torchrun finds it."""
        self.raw.set("run_dir", run_dir)

    def earlier_run_dir(self) -> str | None:
        """The run dir an earlier restart round trained in (torchrun), if any."""
        if self.world_info.restart == 0:
            return None
        try:
            if self.raw.check(["run_dir"]):
                return self.raw.get("run_dir").decode()
        except Exception:
            return None
        return None

    # -------------------------------------------------------------- the run's config
    def publish(self, spec: RunSpec) -> None:
        """Rank 0: hand the run's spec (resolved config, run dir) to the other tasks, as
        JSON: what arrives over the network is read as data, never unpickled."""
        self.store.set("payload", spec.to_json())

    def abort(self, kind: str, message: str = "") -> None:
        """Tell every task to stop: ``kind`` is ``timeout`` (a collective waited too long),
        ``error`` (a rank failed) or ``start`` (rank 0 could not start the run)."""
        try:
            if not self.store.check(["abort"]):
                self.store.set("abort", json.dumps({"by": self.rank, "kind": kind, "message": message}))
        except Exception:
            pass

    def reachable(self) -> bool:
        """Whether the store (rank 0's process) still answers."""
        try:
            self.store.check(["abort"])
            return True
        except Exception:
            return False

    def aborted(self) -> dict | None:
        """The abort record (``by``, ``kind``, ``message``) if some rank raised it; a store that
        no longer answers counts as rank 0's abort."""
        try:
            if self.store.check(["abort"]):
                return json.loads(self.store.get("abort"))
        except Exception:
            return {"by": 0, "kind": "error", "message": "rank 0 ended"}
        return None

    def wait_payload(self) -> RunSpec | None:
        """Other ranks: rank 0's spec of the run, or ``None`` when it aborted the start."""
        deadline = time.time() + PAYLOAD_TIMEOUT_S
        while time.time() < deadline:
            try:
                if self.store.check(["payload"]):
                    from ddpexp.config.spec import RunSpec

                    return RunSpec.from_json(self.store.get("payload"))
            except Exception:
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
        except Exception:
            pass

    def reports(self, section: str) -> dict[int, dict]:
        """``{rank: record}`` of the ranks that reported under ``section`` so far."""
        out = {}
        for r in range(self.world):
            try:
                if self.store.check([f"{section}/{r}"]):
                    out[r] = json.loads(self.store.get(f"{section}/{r}"))
            except Exception:
                break
        return out

    def gone(self) -> set[int]:
        """The ranks on this host whose process has ended: they will report nothing more.
        mpirun, on a rank's death, sends the others SIGCONT, SIGTERM a second later and
        SIGKILL a second after that (OpenMPI 4: ``odls_base_sigkill_timeout=1``), so
        rank 0 cannot wait out :data:`REPORT_WAIT_S` for a rank that was SIGKILLed."""
        host = socket.gethostname()
        return {r for r, seen in self.reports("joined").items()
                if seen.get("host") == host and not runlock.pid_runs(int(seen["pid"]))}

    def failure_message(self, kind: str, timeout_s: float, log_file: str) -> str:
        """Rank 0: one message for the step's failure, once the others have reported."""
        deadline = time.time() + REPORT_WAIT_S.get(kind, 3.0)
        while time.time() < deadline:
            heard = set(self.reports("failed")) | set(self.reports("stalled"))
            if len(heard) >= self.world or heard | self.gone() >= set(range(self.world)):
                break
            time.sleep(POLL_S)
        failed, stalled = self.reports("failed"), self.reports("stalled")
        joined = {0, *self.reports("joined"), *failed, *stalled}
        w = self.world_info
        missing = [r for r in range(self.world) if r not in joined]
        return describe_step_failure(failed, stalled, self.world, timeout_s, log_file,
                                     w.whole, missing=missing,
                                     store=f"{w.master_addr}:{w.master_port}")

    # -------------------------------------------------------------- leaving together
    @property
    def leaves_together(self) -> bool:
        """Whether the ranks of a failed run end at one moment (:data:`LEAVE_S`): torchrun
        agents on several nodes, one of which hosts the store the others' agents use."""
        return self.world_info.launcher == "torchrun" and self.world_info.nodes > 1

    def leave_together(self) -> None:
        """Rank 0, its failure told: name the moment every rank ends, and wait for it."""
        deadline = time.time() + LEAVE_S
        try:
            self.store.set("leave", str(deadline))
        except Exception:
            return
        time.sleep(max(0.0, deadline - time.time()))

    def wait_to_leave(self) -> None:
        """A failed rank other than 0: wait for the moment rank 0 names (at most
        :data:`LEAVE_WAIT_S`, or until the store is gone)."""
        give_up = time.time() + LEAVE_WAIT_S
        while time.time() < give_up:
            try:
                if self.store.check(["leave"]):
                    deadline = float(self.store.get("leave"))
                    time.sleep(max(0.0, min(deadline, give_up) - time.time()))
                    return
            except Exception:
                return
            time.sleep(POLL_S / 5)


class Listener:
    """A daemon thread per rank that ends a stuck rank once the step is aborted (see the
    module's docstring). ``on_stuck`` runs before the process ends (rank 0 records the
    failure there)."""

    def __init__(self, step: Step, log_file: str,
                 on_stuck: Callable[[str], None] | None = None) -> None:
        self.step, self.log_file, self.on_stuck = step, log_file, on_stuck
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="ddpexp-slurm", daemon=True)

    def __enter__(self) -> Listener:
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
            waits = self.step.leaves_together and kind == "error"
            grace = LEAVE_GRACE_S if waits else GRACE_S.get(kind, 2.0)
            if self._done.wait(grace) or self.step.failing.is_set():
                return  # this rank's own code saw the failure and handles it
            if waits:
                self._leave_with_the_others()
            self._end_stuck(kind)

    def _leave_with_the_others(self) -> None:
        """A rank waiting in a collective for a failed rank that stays until the ranks leave
        together (:data:`LEAVE_S`) never sees that rank's sockets close: it is no cause of
        the failure, and leaves with the others (rank 0 once it has told the failure)."""
        if self.on_stuck is not None:
            try:
                self.on_stuck("error")
            except Exception:
                pass
            self.step.leave_together()
        else:
            self.step.wait_to_leave()
        logging.shutdown()
        os._exit(EXIT_FAILED)

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
            except Exception:
                pass
        runlock.release_all()  # rank 0 holds the run dir's lock; os._exit runs no finally
        logging.shutdown()
        os._exit(EXIT_FAILED)

    def _dump_stack(self) -> None:
        try:
            with open(self.log_file, "a") as f:
                f.write(f"[rank{self.step.rank}] stalled while the other ranks ("
                        f"{self.step.world_info.what}) waited for it; its Python stack (most "
                        "recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass


# The step's store outlives the calls that use it: ``__main__`` opens it before Hydra runs
# (so that a start that fails can still tell the other tasks), the launch publishes the
# config through it. A process belongs to one step at most: one handle per process.
_STEP: list[Step] = []


def current(world: World | None = None) -> Step:
    """This process's handle on its world's store, opened on first use."""
    if not _STEP:
        found = world or detect()
        if found is None:
            raise ConfigError("no launcher started the ranks of this process")
        _STEP.append(Step.connect(found))
    return _STEP[0]


# ------------------------------------------------------------------------------ tasks
def lead(step: Step, main: Callable[[], Any]) -> None:
    """Global rank 0: run ``main`` (Hydra's, which reaches :func:`run_rank` through the
    launch), and abort the step's start if it ends without having published the config."""
    try:
        main()
    except SystemExit as exc:
        if step.failing.is_set() and step.leaves_together:
            # The run's message now, then the end at the moment the other ranks end too.
            code = exc.code
            if isinstance(code, str):
                _say(code)
            step.leave_together()
            from ddpexp.launch.proc import exit_now

            exit_now(code if isinstance(code, int) and code else EXIT_FAILED)
        raise
    finally:
        try:
            published = step.store.check(["payload"])
        except Exception:
            published = True
        if not published:
            step.abort("start")
            # The store ends with this process: the other tasks must have read the abort
            # first, or they would wait for a store that is gone.
            step.wait_joined()


def follow(step: Step) -> int:
    """A task other than rank 0: wait for rank 0's config and run as this rank. Returns the
    exit status; a failure is reported by rank 0, so this task prints nothing of it."""
    spec = step.wait_payload()
    if spec is None:
        return EXIT_FAILED  # rank 0 said why (a bad override, a run dir already taken)
    own = own_terminal(step.world_info)
    if own:
        _say(f"rank {step.rank} of {step.world} ({step.world_info.label}): rank 0, on "
             f"{step.world_info.master_addr}, writes the run dir and its log {spec.log_file}; "
             "this rank's warnings and errors go to that log too, and show here")
    try:
        run_rank(step, spec)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_FAILED
    except BaseException as exc:
        if own:
            _say(f"rank {step.rank} {rank_error(exc)[0]}; the run's message is rank 0's, its "
                 f"traceback in {spec.log_file}")
        return EXIT_FAILED
    return 0


def own_terminal(world: World) -> bool:
    """Whether this rank's output is seen apart from rank 0's: each pod of an env:// world
    (a Kubernetes PyTorchJob's worker logs), the first rank of another node's torchrun agent.
    (srun and mpirun gather every rank's output where rank 0's shows.)"""
    if world.rank == 0:
        return False
    return world.launcher == "env" or (world.launcher == "torchrun" and world.nodes > 1
                                       and world.local_rank == 0)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_rank(step: Step, spec: RunSpec) -> dict | None:
    """Run the worker as this task's rank; a failure is reported to the step, and on global
    rank 0 it becomes one :class:`RunFailed` naming the ranks at fault."""
    from ddpexp.launch.worker import run_worker  # torch and the trainer: only where a rank runs

    timeout_s = float(spec.trainer.dist_timeout_s)
    started = time.time()
    on_stuck = _record_stuck(step, spec, timeout_s, started) if step.rank == 0 else None
    if step.rank == 0 and threading.current_thread() is threading.main_thread():
        _keep_through_the_launchers_stop(step)
    with Listener(step, str(spec.log_file), on_stuck):
        try:
            return run_worker.__wrapped__(spec, store=step.store)
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
                _tell(spec, describe_step_failure(seen, {}, step.world, timeout_s,
                                                  str(spec.log_file), step.world_info.whole),
                      started)
            if step.rank != 0:
                if step.leaves_together:
                    step.wait_to_leave()
                raise
            # A launcher that ends every rank once one has exited (torchrun's agent SIGTERMs
            # them, then SIGKILLs them 30 s later) must not end rank 0 before it has written
            # the run's message and record: the run failed, it was not interrupted.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise RunFailed(step.failure_message(kind, timeout_s, str(spec.log_file))) from None


def _keep_through_the_launchers_stop(step: Step) -> None:
    """Rank 0: a SIGTERM that comes once another rank has failed (and told the step) is the
    launcher ending every rank because that one exited (torchrun's agent does): rank 0
    ignores it, since its failure path is about to write the run's message and record (while
    training, the loop's own handler takes the signal first). Before training (a rank that
    fails in its probe batch while rank 0 still builds) it would end rank 0 with nothing
    said. Any other SIGTERM does what it did before."""
    previous = signal.getsignal(signal.SIGTERM)

    def handle(signum: int, frame: Any) -> None:
        abort = step.aborted()
        if abort is not None and abort.get("by") != step.rank:
            return  # another rank's failure: rank 0's own failure path follows
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handle)


def _record_stuck(step: Step, spec: RunSpec, timeout_s: float,
                  started: float) -> Callable[[str], None]:
    """What global rank 0 does when it is the stuck rank: the record and the message that its
    own failure path would have written (the wall time counted from ``started``)."""
    def record(kind: str) -> None:
        _tell(spec, step.failure_message(kind, timeout_s, str(spec.log_file)), started)

    return record


def _tell(spec: RunSpec, message: str, started: float) -> None:
    """The step's failure from a rank other than the usual writer's path: ``metrics.json``
    marked ``failed``, the message in the run's log and, once, on the terminal."""
    record_failure(spec.run_dir, RunFailed(message), started)
    try:
        with open(spec.log_file, "a") as f:
            f.write(message + "\n")
    except OSError:
        pass
    print(message, file=sys.stderr, flush=True)
