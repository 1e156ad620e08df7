"""What each worker process runs: logging, threads, process group, the trainer, teardown.

A worker gets the run's :class:`~ddpexp.config.spec.RunSpec` (the resolved config, typed, and
the run dir the parent chose); it never re-enters Hydra or looks at ``sys.argv``, which is what
keeps every rank in the one run dir.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddpexp.config.spec import RunSpec
from ddpexp.launch import proc
from ddpexp.launch.failures import explain_os_error
from ddpexp.launch.world import OWN_WORKER_ENV
from ddpexp.runtime import dist as ddist
from ddpexp.runtime.jobtag import tag_console
from ddpexp.strategies.registry import strategy_class
from ddpexp.training.trainer import Trainer

log = logging.getLogger("ddpexp")

# The exit status of a worker that stopped on a signal after its checkpoint (EX_TEMPFAIL).
EXIT_INTERRUPTED = 75

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s]{rank} - %(message)s"


def setup_logging(rank: int, log_file: str) -> None:
    """Rank 0 logs INFO to stdout and the run's log; the other ranks only their warnings and
    errors, tagged with their rank, so that a failing rank is seen without the noise. A
    sweep job's workers put the job's ``#N`` before each console line."""
    tag = "" if rank == 0 else f"[rank{rank}]"
    formatter = logging.Formatter(LOG_FORMAT.format(rank=tag))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    level = logging.INFO if rank == 0 else logging.WARNING
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)  # as Hydra does
    for handler in (console, logging.FileHandler(log_file, mode="a")):
        handler.setFormatter(formatter)
        handler.setLevel(level)
        root.addHandler(handler)
    root.setLevel(level)
    tag_console()  # a sweep job's workers: #N before each console line, as the job's own
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def set_threads(local_world_size: int) -> None:
    """Split this process's cores (its affinity mask: a sweep slice, a cgroup) evenly
    between the workers of this node, so that workers do not oversubscribe the CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, local_world_size)))


@record
def run_worker(spec: RunSpec, store: dist.Store | None = None) -> dict | None:
    """Run the spec's mode (:mod:`ddpexp.modes`: train, or for ddpexp.eval evaluate a
    checkpoint) as one rank; global rank 0 returns the run's metrics, the others ``None``.
    ``store``: one the ranks share already (a SLURM step's), for the process group."""
    ctx = ddist.context_from_env(spec.trainer.gpus)
    if not spec.in_process:
        setup_logging(ctx.rank, str(spec.log_file))
    set_threads(ctx.local_world_size)
    ddist.init_process_group(ctx, spec.trainer.dist_timeout_s,
                             force=strategy_class(spec.trainer.strategy).spans_processes,
                             store=store)
    ctx = ddist.with_mesh(ctx, spec.trainer.tp)
    if not spec.in_process:
        # A full disk costs the log its lines, not a "--- Logging error ---" traceback per
        # line (launch.failures.quiet_logging_errors; in process, the run's parent set it).
        logging.raiseExceptions = False
    try:
        result = spec.mode.run(Trainer.from_spec(spec, ctx), spec)
        interrupted = isinstance(result, dict) and result.get("status") == "interrupted"
        if interrupted and ctx.world_size > 1:
            dist.barrier()  # rank 0 has written metrics.json: nobody exits before that
    except OSError as exc:  # an unreadable data.root, a full disk: one message, not errno
        explained = explain_os_error(exc, spec.config["data"].get("root"), str(spec.run_dir))
        _log_traceback(spec.log_file, ctx.rank, explained)
        raise explained from None
    except Exception:
        _log_traceback(spec.log_file, ctx.rank)
        raise
    finally:
        ddist.destroy_process_group()
    if interrupted and os.environ.get(OWN_WORKER_ENV):
        # torch elastic's worker wrapper would now wait for the agent to collect the return
        # value, but an agent shutting down on a signal never does: it would wait
        # trainer.shutdown_grace_s and then SIGKILL. The checkpoint is on disk: exit now,
        # with a code the launcher reads as "interrupted" should the agent not be stopping.
        # (A rank that torchrun started runs Hydra's task itself: rank 0 returns, to report
        # the interruption and how to continue.)
        logging.shutdown()
        raise SystemExit(EXIT_INTERRUPTED)
    if not spec.in_process and "TORCHELASTIC_RUN_ID" in os.environ:
        # An elastic worker that succeeded: torch elastic hands the result to the agent
        # before the process ends, and the agent then waits for the process to exit, so
        # skipping the interpreter teardown (1-2 s with torch loaded) shortens every run.
        atexit.register(proc.exit_now, 0)
    return result if ctx.is_main else None


def _log_traceback(log_file: Path, rank: int, explained: BaseException | None = None) -> None:
    """The full traceback goes to the run's log file; the terminal gets one line per failed
    rank from the parent (and the traceback only with HYDRA_FULL_ERROR=1), the traceback's
    last line, or ``explained``, the error the rank raises in its place, where there is one
    (the parent reads a rank's cause from there when its agent saw another rank fail first)."""
    last = f"{type(explained).__name__}: {explained}\n" if explained is not None else ""
    try:
        with open(log_file, "a") as f:
            f.write(f"[rank{rank}] worker failed (pid {os.getpid()}):\n{traceback.format_exc()}{last}")
    except OSError:
        pass
