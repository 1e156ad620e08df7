"""Fan-out of one run: decide the workers, start them on torch elastic, report the outcome.

This is the one path every run takes, with or without ``-m``: the task function calls
:func:`run`, which runs the worker in this process (one worker, no restarts), hands the
workers to torch elastic's agent (several workers, restarts, several nodes), or becomes one rank
of a SLURM job step. Workers receive one :class:`~ddpexp.config.spec.RunSpec`, built here: the
resolved config, typed, the layout and the run dir chosen here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, cast

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddpexp.config.cli import env_flag
from ddpexp.config.commands import sweep_command
from ddpexp.config.schema import to_plain
from ddpexp.config.spec import Plan, RunSpec
from ddpexp.config.validate import validate
from ddpexp.errors import ConfigError, DdpexpError, RunDiverged, RunFailed, RunInterrupted
from ddpexp.launch import ranks
from ddpexp.launch.failures import (
    describe_elastic_failure,
    describe_own_failure,
    guard_run,
    resume_hint,
)
from ddpexp.launch.resources import check_resources, node_cores, oom_kills
from ddpexp.launch.resume import checked_changes
from ddpexp.launch.watchdog import Watchdog
from ddpexp.launch.world import OWN_WORKER_ENV, World, detect
from ddpexp.record import record_failure, record_wall_time, run_started
from ddpexp.runtime.signals import stop_signals
from ddpexp.strategies import registry

log = logging.getLogger("ddpexp")


def plan_run(trainer: Any, visible_gpus: int | None = None) -> Plan:
    """Resolve ``strategy=auto`` and ``procs=null`` and reject layouts that cannot run."""
    gpus, nodes = int(trainer.gpus), int(trainer.nodes)
    strategy = _plain(trainer.strategy)
    kind = None if registry.is_auto(strategy) else registry.strategy_class(strategy)
    if gpus > 0:
        if visible_gpus is None:
            import torch

            visible_gpus = torch.cuda.device_count()
        if gpus > visible_gpus:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
            fix = f"trainer.gpus={visible_gpus}" if visible_gpus else "trainer.gpus=0 to train on the CPU"
            raise ConfigError(
                f"trainer.gpus={gpus} but {visible_gpus} GPU(s) are visible{where}. "
                f"Use {fix}" + (", or trainer.gpus=0 for the CPU" if visible_gpus else "") + "."
            )
    procs = trainer.procs
    if kind is not None and kind.one_process:
        if procs not in (None, 1) or nodes != 1:
            raise ConfigError(
                f"trainer.strategy={registry.label(strategy)} is one process on one node "
                f"({kind.__name__} over trainer.gpus); got trainer.procs={procs}, trainer.nodes={nodes}. "
                "Use trainer.strategy=ddp for several processes."
            )
        check_tensor_parallel(trainer, strategy, 1, "one process")
        return Plan(strategy, 1, 1, gpus)
    if procs is None:
        procs = gpus if gpus > 0 else 1
    if gpus > 0 and procs != gpus:
        raise ConfigError(
            f"trainer.procs={procs} with trainer.gpus={gpus}: on GPUs there is one worker per GPU; "
            "leave trainer.procs unset"
        )
    world = procs * nodes
    if kind is not None and not kind.spans_processes and world > 1:
        raise ConfigError(
            f"trainer.strategy={registry.label(strategy)} runs one process, but trainer.procs x "
            f"trainer.nodes = {world}; use trainer.strategy=ddp (or auto)"
        )
    if kind is None:
        strategy = registry.resolve_auto(world)
    check_tensor_parallel(trainer, strategy, world,
                          f"trainer.gpus={gpus} x trainer.nodes={nodes}" if gpus else
                          f"trainer.procs={procs} x trainer.nodes={nodes}")
    return Plan(strategy, procs, nodes, gpus)


def check_tensor_parallel(trainer: Any, strategy: Any, world: int, layout: str) -> None:
    """Refuse a ``trainer.tp`` that does not divide the ``world`` of ``layout`` into whole
    data-parallel replicas, or that ``strategy`` (resolved) cannot run."""
    tp = int(getattr(trainer, "tp", 1))
    if tp == 1:
        return
    if world % tp:
        fits = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ConfigError(
            f"trainer.tp={tp} does not divide the world size {world} ({layout}): the "
            f"data-parallel degree is the world size / trainer.tp. Use a trainer.tp of {fits}, "
            f"or a world size that is a multiple of {tp}")
    if registry.tensor_parallel_class(registry.strategy_class(strategy)) is None:
        raise ConfigError(
            f"trainer.strategy={registry.label(strategy)} cannot split the model by tensor "
            f"parallelism (trainer.tp={tp}); use trainer.strategy=ddp or fsdp")


def _plain(strategy: Any) -> Any:
    """``trainer.strategy`` as plain Python (a ``_target_`` node as a dict)."""
    if isinstance(strategy, DictConfig):
        return OmegaConf.to_container(strategy, resolve=True)
    return strategy


def overrides_as_hparams(overrides: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=0.1", "model=mlp"]`` -> ``{"optimizer.lr": 0.1, "model": "mlp"}``: the
    hyperparameters a sweep varies, as TensorBoard's HParams dashboard shows them."""
    out: dict[str, Any] = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element().lstrip("+~")
        if key in ("resume",) or key.startswith("hydra"):
            continue
        value = o.value()
        out[key] = value if isinstance(value, (bool, int, float, str)) else o.get_value_element_as_str()
    return out


def _prepare(cfg: DictConfig, hydra_cfg: Any, run_dir: Path, world: World | None) -> RunSpec:
    """Check the run and lay it out: the spec the workers get, with the checkpoint it resumes
    from (None: a fresh start). Raises the DdpexpError that refuses it."""
    # torch and the trainer: imported by a run, not by every importer of this module.
    from ddpexp.checkpoint import io as checkpoint

    validate(cfg, launched_elsewhere=world is not None)
    plan = world_plan(cfg.trainer, world) if world is not None else plan_run(cfg.trainer)
    check_resources(plan, cores=node_cores(launched_elsewhere=True) if world is not None else None)
    try:
        plain = to_plain(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"the config does not resolve: {exc}") from None
    check_parts(plain, run_dir)
    spec = RunSpec.build(plain, plan, run_dir=run_dir, log_file=run_dir / f"{hydra_cfg.job.name}.log",
                         hparams=overrides_as_hparams(list(hydra_cfg.overrides.task)),
                         sweep_dir=Path(hydra_cfg.sweep.dir).absolute()
                         if hydra_cfg.mode == RunMode.MULTIRUN else None,
                         origin=run_origin(hydra_cfg, world))
    resume = checkpoint.find(cfg.resume, run_dir, base=Path(hydra_cfg.runtime.cwd))
    if resume is None and cfg.resume is None and under_submitit():
        # A submitit job requeued after SLURM's pre-timeout signal runs again in its own job
        # dir with the same overrides: the checkpoint it saved there is where it continues.
        last = checkpoint.newest_last(run_dir / "checkpoints")
        if last is not None:
            log.info("requeued submitit job: continuing %s", last)
            resume = last
    if resume is None:
        return spec
    saved = checkpoint.verify(resume)
    # What the resume changes, refused here (before a worker starts or a line is logged)
    # where the checkpoint cannot take it; the trainer applies the rest.
    changes = checked_changes(saved["config"], spec.config, cfg.resume, run_dir, hydra_cfg)
    return dataclasses.replace(spec, resume_from=resume, resume_changes=changes)


def run_origin(hydra_cfg: Any, world: World | None) -> dict:
    """Where the run came from, for its ``provenance.json`` (``RunSpec.origin``): the command
    line as typed (a sweep's, for its job), this job's overrides, the working dir, the config
    dirs on the search path, and who started the ranks."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return {
        "argv": (sweep_command() if multirun else None) or sys.argv[1:],
        "job_overrides": list(hydra_cfg.overrides.task),
        "cwd": str(hydra_cfg.runtime.cwd),
        "config_dirs": [str(s.path) for s in hydra_cfg.runtime.config_sources
                        if s.schema == "file" and s.path],
        "mode": "multirun" if multirun else "run",
        "launcher": world.launcher if world is not None else "ddpexp",
        "executable": sys.executable,
    }


def _record_refusal(cfg: DictConfig, run_dir: Path, exc: BaseException) -> None:
    """A sweep job refused before training leaves its mark where its trainings are recorded
    (an MLflow run marked FAILED, its error as a tag): see
    :func:`ddpexp.loggers.record_refusal`."""
    from omegaconf import OmegaConf

    from ddpexp.loggers import StoreRefused, record_refusal

    if isinstance(exc, StoreRefused):  # the store itself is what cannot be used
        return
    try:
        config = cast(dict, OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException:
        config = cast(dict, OmegaConf.to_container(cfg, resolve=False))
    hparams = overrides_as_hparams(list(HydraConfig.get().overrides.task))
    record_refusal(config.get("logger") or {}, run_dir, config, hparams, str(exc))


@guard_run
def run(cfg: DictConfig) -> float | None:
    """The task function's body: run one experiment and return its monitored metric."""
    started = run_started()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    world = detect()
    if world is not None and world.rank > 0:
        # A task of a submitit job with several tasks runs this too; rank 0 speaks for all.
        log.setLevel(logging.WARNING)
    try:
        spec = _prepare(cfg, hydra_cfg, run_dir, world)
    except DdpexpError as exc:
        if hydra_cfg.mode == RunMode.MULTIRUN and (world is None or world.rank == 0):
            _record_refusal(cfg, run_dir, exc)
        raise
    plan = spec.plan
    log.info("run dir: %s", run_dir)
    tp = spec.trainer.tp
    log.info("%d worker(s)%s: strategy=%s%s, %s", plan.world_size,
             f" ({world.label})" if world is not None else "", registry.label(plan.strategy),
             f", dp={plan.world_size // tp} x tp={tp}" if tp > 1 else "",
             f"{plan.gpus} GPU(s) per node" if plan.gpus else "CPU")
    if spec.resume_from is None and spec.config["resume"] == "auto":
        log.info("resume=auto: no checkpoint in %s, starting from scratch", run_dir / "checkpoints")
    preempt = Preemption()
    try:
        result = dispatch(spec)
    except RunInterrupted as exc:
        record_failure(run_dir, exc, started)
        preempt.requeue(exc.signal)
        raise
    except DdpexpError as exc:
        record_failure(run_dir, exc, started)
        raise
    if result is None:  # not global rank 0 of a SLURM step
        return None
    record_wall_time(run_dir, result, started)
    if result["status"] == "interrupted":
        by = result.get("stopped_by")
        preempt.requeue(by)
        raise RunInterrupted((f"stopped by {by}; " if by else "") + resume_hint(run_dir, hydra_cfg),
                             signal=by)
    if result["status"] == "diverged":
        return _diverged(result, hydra_cfg)
    best = result["best"].get(result["monitor"])
    tested = {k: v for k, v in result.get("test", {}).items() if k.startswith("test/")}
    log.info("%s: %d epochs, %d steps, best %s %s%s; run dir %s", result["status"],
             result["epochs"], result["steps"], result["monitor"],
             "n/a" if best is None else f"{best:.4f}",
             "".join(f", {k} {v:.4f}" for k, v in tested.items()), run_dir)
    return best  # selection is on validation only: the test metrics are never returned


def check_parts(plain: dict, run_dir: Path) -> None:
    """Refuse a bad ``_target_`` of the task, model, data, optimizer or scheduler (one that
    does not import, a key it takes no argument for) and a bad ``callbacks`` or ``logger``
    entry (no ``_target_``, one that does not import, a class of the wrong kind) with one
    message, before any worker starts; then let each logger prepare its store (an MLflow
    database's schema, say)."""
    from ddpexp.callbacks import Callback
    from ddpexp.config import components
    from ddpexp.loggers import outputs_root, prepare_loggers

    components.check_nodes(plain)
    components.check("callbacks", plain.get("callbacks"), Callback)
    prepare_loggers(plain.get("logger") or {}, outputs_root(run_dir))


def _diverged(result: dict, hydra_cfg: Any) -> float:
    """A run whose training loss went non-finite: on its own it fails with the trainer's
    message; as a sweep job it returns the worst value for the monitored direction, so that
    a sweeper can rank it and the sweep goes on (its row says ``diverged``)."""
    message = result.get("error") or "training diverged"
    if hydra_cfg.mode != RunMode.MULTIRUN:
        raise RunDiverged(message)
    log.error("%s", message)
    return float("-inf") if result.get("monitor_mode") == "max" else float("inf")


def under_submitit() -> bool:
    """Whether this process is a submitit job (Hydra's submitit_local/submitit_slurm)."""
    return any(key.startswith("SUBMITIT_") for key in os.environ)


class Preemption:
    """SLURM's pre-timeout signal under submitit: submitit's handler for it requeues the job
    (and exits). ddpexp's workers take that signal first, to checkpoint; once they have, the
    handler that was installed before the run is called, so that the requeue still happens."""

    def __init__(self) -> None:
        self.handlers = {sig.name: signal.getsignal(sig) for sig in stop_signals()
                         if sig not in (signal.SIGTERM, signal.SIGINT)}

    def requeue(self, signal_name: str | None) -> None:
        """Hand ``signal_name`` on to the pre-run handler if it is a pre-timeout signal that
        a Python handler (submitit's) was waiting for; that handler usually exits."""
        handler = self.handlers.get(signal_name or "")
        if callable(handler) and signal_name:
            log.warning("%s: checkpoint saved; handing the signal to submitit to requeue the job",
                        signal_name)
            handler(getattr(signal, signal_name), None)


def dispatch(spec: RunSpec) -> dict | None:
    """Run ``spec`` as its plan says: in this process, under torch elastic, or as this
    SLURM task's rank; global rank 0 gets the worker's result. Training runs and
    ``ddpexp.eval`` both come through here."""
    from ddpexp.launch.worker import run_worker

    world = detect()
    if world is not None:
        step = ranks.current(world)
        if step.rank == 0:
            step.publish(spec)
            if world.launcher == "torchrun":
                step.remember_run_dir(str(spec.run_dir))
        return ranks.run_rank(step, spec)
    if spec.plan.world_size == 1 and spec.trainer.max_restarts == 0:
        # No elastic agent: this process is the worker, so it takes SIGTERM/SIGINT itself.
        try:
            return run_worker.__wrapped__(dataclasses.replace(spec, in_process=True))
        except DdpexpError:
            raise
        except Exception as exc:  # what the agent reports of a failed worker, said the same way
            raise RunFailed(describe_own_failure(exc)) from exc
    return _elastic(spec)


def world_plan(trainer: Any, world: World) -> Plan:
    """Another launcher started one process per rank: the world is its ranks, DDP (or FSDP)
    across them. A ``trainer.procs``, ``trainer.gpus`` or ``trainer.nodes`` that asks for
    another layout than the launcher's is refused: the launcher, not ddpexp, decides how many
    workers there are."""
    strategy = _plain(trainer.strategy)
    size, per_node = world.world_size, world.local_world_size
    if registry.is_auto(strategy):
        strategy = registry.resolve_auto(size, launched_elsewhere=True)
    if not registry.strategy_class(strategy).spans_processes:
        raise ConfigError(
            f"trainer.strategy={registry.label(strategy)} cannot span the {size} ranks of "
            f"{world.what}; use trainer.strategy=ddp or fsdp (or start one process)"
        )
    gpus, procs, nodes = int(trainer.gpus), trainer.procs, int(trainer.nodes)
    own = _per_node_flag(world, per_node)
    if procs is not None and int(procs) != per_node:
        raise ConfigError(
            f"trainer.procs={procs}, but {world.what} are {per_node} process(es) per node, each "
            f"one rank ({own}): leave trainer.procs unset, or start {procs} per node "
            f"({_per_node_flag(world, int(procs))})"
        )
    if gpus > 0 and gpus != per_node:
        raise ConfigError(
            f"trainer.gpus={gpus}, but {world.what} are {per_node} process(es) per node ({own}), "
            f"one per GPU: start {gpus} per node ({_per_node_flag(world, gpus)}), or use "
            f"trainer.gpus={per_node}"
        )
    problem = ranks.nodes_problem(nodes, world)
    if problem:
        raise ConfigError(problem)
    check_tensor_parallel(trainer, strategy, size, world.what)
    return Plan(strategy, per_node, world.nodes, gpus)


def _per_node_flag(world: World, n: int) -> str:
    """How the launcher is told to start ``n`` ranks per node."""
    return {"slurm": f"srun --ntasks-per-node={n}", "torchrun": f"torchrun --nproc-per-node={n}",
            "mpi": f"mpirun --npernode {n}"}.get(world.launcher, f"LOCAL_WORLD_SIZE={n}")


def _elastic(spec: RunSpec) -> dict | None:
    """Start the workers under torch elastic's agent and wait for them.

    One node: a c10d rendezvous on a loopback port picked now (a concrete port, so restart
    rounds re-form the group). Several nodes: the user's ``rdzv_endpoint``, shared by all.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ddpexp.launch.worker import EXIT_INTERRUPTED, run_worker
    from ddpexp.runtime.dist import free_port

    plan, t = spec.plan, spec.trainer
    # torch elastic keeps its per-run error files here; removed when the run ends (left to
    # itself it leaves an empty /tmp/torchelastic_* dir behind per run).
    elastic_dir = Path(tempfile.mkdtemp(prefix="ddpexp-elastic-"))
    env_keys = {}
    if plan.nodes == 1:
        endpoint, local_addr = f"127.0.0.1:{free_port()}", "127.0.0.1"
        run_id = uuid.uuid4().hex
        # Keep the workers' own sockets on loopback too.
        env_keys = {"GLOO_SOCKET_IFNAME": "lo"} if plan.gpus == 0 else {"NCCL_SOCKET_IFNAME": "lo"}
    else:
        endpoint, local_addr = str(t.rdzv_endpoint), None
        run_id = "ddpexp-" + endpoint.replace(":", "-")
    # The workers are ddpexp's own: a process they start is no rank of another launcher.
    env_keys[OWN_WORKER_ENV] = "1"
    for key, value in env_keys.items():
        os.environ.setdefault(key, value)
    # The agent logs each failed worker's traceback; the run's own message names the rank and
    # the cause, and the traceback is in the run's log (or shown with HYDRA_FULL_ERROR=1).
    quiet = logging.WARNING if env_flag("HYDRA_FULL_ERROR") else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(quiet)
    config = LaunchConfig(
        min_nodes=plan.nodes,
        max_nodes=plan.nodes,
        nproc_per_node=plan.procs,
        run_id=run_id,
        role="ddpexp",
        rdzv_endpoint=endpoint,
        rdzv_backend="c10d",
        rdzv_configs={"timeout": int(t.rdzv_timeout_s)},
        max_restarts=int(t.max_restarts),
        monitor_interval=0.1,
        # CPU workers are forked from this process, which has imported torch, Hydra and
        # ddpexp already, so no worker imports them again (scripts/bench.py: 20-25% less CPU
        # for a short 2-worker run, and a smaller largest process). GPU workers are spawned:
        # a child forked after its parent touched CUDA cannot use CUDA.
        start_method="fork" if plan.gpus == 0 else "spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(elastic_dir)),
        shutdown_timeout=int(t.shutdown_grace_s),
        # The agent forwards these to the workers, which stop at a step boundary, checkpoint
        # and exit; it SIGKILLs those still running after shutdown_timeout.
        signals_to_handle=",".join(sig.name for sig in stop_signals()) + ",SIGHUP,SIGQUIT",
    )
    # The agent replaces these handlers and never puts them back.
    saved = {sig: signal.getsignal(sig) for sig in (*stop_signals(), signal.SIGHUP, signal.SIGQUIT)}
    log_file = str(spec.log_file)
    watchdog = Watchdog(plan.procs, float(t.dist_timeout_s), log_file)
    oom_before = oom_kills()
    try:
        with watchdog:
            results = elastic_launch(config, run_worker)(spec)
    except ChildFailedError as exc:
        if watchdog.message:
            raise RunFailed(watchdog.message) from None
        if all(f.exitcode == EXIT_INTERRUPTED for f in exc.failures.values()):
            raise RunInterrupted(resume_hint(spec.run_dir, None)) from None
        raise RunFailed(describe_elastic_failure(
            exc, oom_before, log_file,
            range(plan.procs) if plan.nodes == 1 else ())) from None
    except SignalException as exc:
        raise RunInterrupted(
            f"stopped by {exc.sigval.name}; " + resume_hint(spec.run_dir, None),
            signal=exc.sigval.name,
        ) from None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        shutil.rmtree(elastic_dir, ignore_errors=True)
        os.environ.pop(OWN_WORKER_ENV, None)
    if watchdog.message:  # a stall the group recovered from by a restart
        log.warning("%s", watchdog.message)
    return results.get(0)
