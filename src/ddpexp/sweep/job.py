"""One sweep job in its own process: ``python -m ddpexp.sweep.job SPEC RESULT``.

The local backend (:mod:`ddpexp.sweep.local`) writes SPEC: first a plain pickle ``{"sys_path",
"cores"}`` (read before anything else is imported, so the CPU affinity is set before torch or
OpenMP start threads), then a cloudpickle of the task function, the job's sweep config, the
Hydra context and Hydra's Singleton state (config store, resolvers), as Hydra's submitit
launcher does. This process restores that state, runs the job with Hydra's ``run_job`` and
writes its ``JobReturn`` to RESULT. The launcher's fork server
(:mod:`ddpexp.sweep.forkserver`) calls :func:`main` the same way in a process it forks. The
task function fans out its own workers from here (ddpexp: on torch elastic); they inherit
this process's affinity, thread variables and visible GPUs.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from typing import Any

log_name = "hydra_plugins.ddpexp_launcher"


class _Announced:
    """Wraps the task function: tags the job's console lines (``#N``), logs where the job
    runs (into the job's own log, which Hydra has configured by then), then calls it."""

    def __init__(self, task_function: Any, num: Any) -> None:
        self.task_function = task_function
        self.num = num

    def __call__(self, cfg: Any) -> Any:
        import logging

        from ddpexp.runtime.jobtag import tag_console

        tag_console()  # the console handlers Hydra has just set up: #N before each line
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        server = sys.modules.get("ddpexp.sweep.forkserver")
        forked_from = getattr(server, "FORKED_FROM", None)
        logging.getLogger(log_name).info(
            "job %s: pid %d, cores %s, OMP_NUM_THREADS=%s, CUDA_VISIBLE_DEVICES=%s, "
            "process group %d, %s",
            self.num, os.getpid(), ",".join(map(str, cores)) or "all",
            os.environ.get("OMP_NUM_THREADS", "unset"),
            os.environ.get("CUDA_VISIBLE_DEVICES", "unset"), os.getpgid(0),
            f"forked from the fork server (pid {forked_from})" if forked_from
            else "a fresh interpreter",
        )
        return self.task_function(cfg)


def _portable(ret: Any) -> bytes:
    """The JobReturn, cloudpickled; a return value or exception that cannot be pickled is
    replaced by a description, so the parent always learns the job's outcome."""
    import cloudpickle

    try:
        return cloudpickle.dumps(ret)
    except Exception:
        value = ret._return_value
        if isinstance(value, BaseException):
            ret._return_value = RuntimeError(
                "".join(traceback.format_exception_only(type(value), value)).strip()
            )
        else:
            ret._return_value = repr(value)
        return cloudpickle.dumps(ret)


def job_workers(cfg: Any) -> int:
    """The worker processes a job's run starts on this machine (a core each, when packing)."""
    trainer = _select(cfg, "trainer", default=None)
    if trainer is None:
        return 1
    procs = _select(trainer, "procs", default=None)
    gpus = int(_select(trainer, "gpus", default=0) or 0)
    try:
        if procs is not None:
            return max(1, int(procs))
    except (TypeError, ValueError):
        return 1
    if gpus <= 1:
        return 1
    # Only here can the strategy matter (dp drives the GPUs from one process): its class,
    # and torch with it, is imported for a job of several GPUs, not for every job.
    from ddpexp.errors import ConfigError
    from ddpexp.strategies.registry import strategy_class

    try:
        one = strategy_class(_select(trainer, "strategy", default="auto"), gpus).one_process
    except ConfigError:  # refused when the job runs
        return 1
    return 1 if one else gpus


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default)


def peak_bytes(config: Any) -> int:
    """The most memory this job's processes held: this process's peak plus, for a run that
    started workers, the largest worker's peak once per worker (the launcher starts no job
    while less than a finished job's peak is available)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    workers = job_workers(config) if child else 0
    return (own + child * workers) * 1024  # ru_maxrss is in KiB on Linux


def restore_hydra(state: dict, rescan: bool) -> None:
    """Hydra's Singleton state as the launcher had it, as ``Singleton.set_state`` restores
    it, save that a process forked by the fork server keeps the plugins the server
    discovered (:func:`ddpexp.sweep.forkserver._warm`) where its import path is the server's
    (``rescan`` False): the discovery imports every plugin module afresh, a few tens of ms."""
    from copy import deepcopy

    from hydra.core.plugins import Plugins
    from hydra.core.singleton import Singleton
    from omegaconf.basecontainer import BaseContainer

    plugins = None if rescan else Singleton._instances.get(Plugins)
    if plugins is None:
        Singleton.set_state(state)
        return
    Singleton._instances = {**state["instances"], Plugins: plugins}
    BaseContainer._resolvers = deepcopy(state["omegaconf_resolvers"])


def main(spec_path: str, result_path: str) -> int:
    """Run the job described in ``spec_path``; write its JobReturn to ``result_path``."""
    with open(spec_path, "rb") as f:
        head = pickle.load(f)
        # The parent's import path: task functions of scripts and test modules unpickle here.
        added = [p for p in head["sys_path"] if p not in sys.path]
        sys.path[:0] = added
        if head["cores"] and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, head["cores"])
        import cloudpickle

        spec = cloudpickle.load(f)

    from hydra.core.utils import JobStatus, run_job, setup_globals

    restore_hydra(spec["singleton_state"], rescan=bool(added))
    setup_globals()
    config = spec["config"]
    ret = run_job(
        hydra_context=spec["hydra_context"],
        task_function=_Announced(spec["task_function"], config.hydra.job.num),
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    if ret.status == JobStatus.FAILED and isinstance(ret._return_value, BaseException):
        exc = ret._return_value
        from hydra.errors import CompactHydraException

        if not isinstance(exc, CompactHydraException):
            # The traceback does not survive pickling: keep it in the job's own log.
            import logging

            logging.getLogger(log_name).error(
                "job %s failed:\n%s", config.hydra.job.num,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
    data = _portable(ret)
    with open(result_path + ".peak", "w") as f:
        json.dump({"peak_bytes": peak_bytes(config)}, f)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1], sys.argv[2])
    # The result is on disk: skip the interpreter teardown, which takes 1-2 s once the job
    # has loaded torch and which the sweep would wait for once per job.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
