"""Run dirs: claimed atomically (two runs started in the same second never share one),
found again for ``resume=``, locked for the run that writes them (:mod:`ddpexp.config.runlock`),
and where Hydra saves a job's config inside one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ddpexp.config import runlock
from ddpexp.errors import ConfigError, RunDirBusy

# Hydra resolves hydra.run.dir / hydra.sweep.dir several times in one process (the sweeper
# creates the sweep dir, the launcher reads it again). Each must see the same answer, so
# the dir made for a requested path is remembered for the life of the process.
_CLAIMED: dict[str, str] = {}


def unique_dir(path: str) -> str:
    """Claim ``path``, or ``path-1``, ``path-2``... if another run got there first.

    ``os.mkdir`` is atomic, so two runs started in the same second never share a dir. The
    claim is remembered by absolute path: the same relative path from another working
    directory (several runs in one process) is another dir.
    """
    key = str(Path(path).absolute())
    if key in _CLAIMED:
        return _CLAIMED[key]
    base = Path(path)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(unwritable_dir_message(base, exc)) from None
    for n in range(10_000):
        candidate = base if n == 0 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(unwritable_dir_message(candidate, exc)) from None
        _CLAIMED[key] = str(candidate)
        return str(candidate)
    raise ConfigError(f"could not create a fresh run dir next to {path}")


def claimed_dirs() -> set[str]:
    """The run and sweep dirs this process created (absolute paths)."""
    return {str(Path(key).parent / Path(d).name) for key, d in _CLAIMED.items()}


def drop_unused_claims(used: Path) -> None:
    """Remove the dirs this process claimed that stayed empty and are not ``used`` (the run
    or sweep dir Hydra settled on), with parents they leave empty. Composing a config that
    overrides ``hydra.run.dir`` (``debug=*`` puts runs in ``outputs/debug/``) resolves the
    overridden value once too, which claims ``outputs/<date>/<time>`` for nothing."""
    used = Path(used).absolute()
    for claimed in claimed_dirs():
        path = Path(claimed)
        while path != used and path not in used.parents and path.name != "outputs":
            try:
                path.rmdir()  # only an empty one
            except OSError:
                break
            path = path.parent


def drop_unstarted_claims() -> None:
    """Remove the run dirs this process claimed that hold nothing but Hydra's config and an
    empty log (a run stopped before its task began), with a parent they leave empty."""
    for claimed in claimed_dirs():
        path = Path(claimed)
        try:
            entries = list(path.iterdir())
            if not all(e.name == ".hydra" or (e.suffix == ".log" and not e.stat().st_size)
                       for e in entries):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        drop_empty_parent(path)


def drop_empty_parent(run_dir: Path) -> None:
    """Remove the parent of a claimed run dir that was removed, where nothing else is left
    in it (``outputs/<date>``; ``outputs`` itself stays)."""
    if Path(run_dir).parent.name != "outputs":
        try:
            Path(run_dir).parent.rmdir()  # only an empty one
        except OSError:
            pass


def unwritable_dir_message(path: Path, exc: OSError) -> str:
    """Why a run dir cannot be made at ``path``, and what to do about it."""
    why = exc.strerror or str(exc)
    return (f"cannot create the run dir {path}: {why}. Run from a directory you can write to, "
            "or point hydra.run.dir (hydra.sweep.dir for -m) at one")


def writable_dir_problem(path: Path) -> str | None:
    """A message if no run dir can be created at ``path`` (a forbidden, read-only or
    unwritable place); creates nothing that stays."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot create the run dir {path}: {probe} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return unwritable_dir_message(Path(path), exc)
    return None


def resume_dir(resume: Any, fresh: str) -> str:
    """The run dir: the one ``resume`` points at (dir or checkpoint file), else ``fresh``.

    ``fresh`` is only claimed (created) when it is the answer, so resuming into an old run
    leaves no empty new dir behind.
    """
    if resume not in (None, "", "auto"):
        target = Path(str(resume)).expanduser()
        if target.is_file() and target.parent.name == "checkpoints":
            return str(target.parent.parent)
        if target.is_dir():
            return str(target)
    return unique_dir(fresh)


def hydra_subdir(output_dir: str) -> str | None:
    """Where Hydra saves this job's config: ``.hydra``, or ``.hydra/resume-N`` when the dir
    already holds a run, so resuming never overwrites the config the run started with.
    ``None`` (nothing saved) in the tasks other than global rank 0 of a SLURM step that all
    run Hydra (a submitit job of several tasks): rank 0 saves it once."""
    if _later_slurm_task():
        return None
    first = Path(output_dir) / ".hydra"
    if not (first / "config.yaml").exists():
        return ".hydra"
    n = 1
    while (first / f"resume-{n}").exists():
        n += 1
    return f".hydra/resume-{n}"


def claimed_subdir(output_dir: str, *, _root_: Any = None) -> str | None:
    """``hydra.output_subdir``'s resolver: take the run dir's lock, then :func:`hydra_subdir`.

    Hydra resolves this after it creates the run dir and right before it saves the job's
    config, the first thing a run writes there, and the resolver is where the dir the run
    writes is known, so that is where the run claims it. A dir that another live run holds
    gets no config saved (None); the task function then refuses the run
    (:func:`ddpexp.launch.failures.guard_run`), with nothing of it written."""
    try:
        lock_run_dir(output_dir, _root_)
    except RunDirBusy:
        return None
    return hydra_subdir(output_dir)


def lock_run_dir(output_dir: str | Path, cfg: Any = None) -> runlock.RunLock | None:
    """Take (once per process) the lock of the run dir ``output_dir`` for the run whose
    config is ``cfg``; None where this process is not the one that owns the run (a later
    task of a SLURM step that all run Hydra: its rank 0 holds the lock). Raises
    :class:`~ddpexp.errors.RunDirBusy` while another live run holds it."""
    if _later_slurm_task():
        return None
    return runlock.claim(output_dir, shared_by=shared_by(cfg))


def shared_by(cfg: Any) -> str | None:
    """:func:`rendezvous_of` the run whose config is ``cfg``."""
    from omegaconf import OmegaConf

    if cfg is None:
        return None
    try:
        return rendezvous_of(OmegaConf.select(cfg, "trainer.nodes", default=1),
                             OmegaConf.select(cfg, "trainer.rdzv_endpoint", default=None))
    except Exception:  # a config that does not resolve is reported by the run itself
        return None


def rendezvous_of(nodes: Any, endpoint: Any) -> str | None:
    """What the processes that share one run dir by design have in common: the rendezvous
    of a ``trainer.nodes>1`` run, whose nodes each run Hydra on the same ``hydra.run.dir``."""
    try:
        several = int(nodes or 1) > 1
    except (TypeError, ValueError):
        return None
    return f"rendezvous {endpoint}" if several and endpoint else None


def _later_slurm_task() -> bool:
    env = os.environ
    try:
        return (int(env.get("SLURM_PROCID", "0")) > 0 and int(env.get("SLURM_NTASKS", "1")) > 1
                and "TORCHELASTIC_RUN_ID" not in env)
    except ValueError:
        return False


# What a run writes into its dir; overwrite=true removes these before the new run starts.
RUN_OUTPUTS = (".hydra", "checkpoints", "tb", "metrics.json", "metrics.csv")


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds (part of) a ddpexp run: its config, checkpoints or metrics."""
    return any((path / name).exists() for name in (".hydra/config.yaml", "checkpoints", "metrics.json"))


def has_checkpoint(run_dir: Path | str) -> bool:
    """Whether the run in ``run_dir`` saved a checkpoint (``last.pt``, ``best.pt``, ...)."""
    try:
        return any((Path(run_dir) / "checkpoints").iterdir())
    except OSError:
        return False


def interrupted_before_training(path: Path) -> bool:
    """Whether ``path`` holds only a run that a signal stopped before it saved a checkpoint
    or counted a step (Ctrl-C while its data loaded): nothing in it that a new run would
    overwrite, so the same command may start the run again there."""
    try:
        record = json.loads((path / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and record.get("status") == "interrupted"
            and not record.get("steps") and not has_checkpoint(path))


def remove_run_outputs(run: Path) -> None:
    """Delete what a run wrote into ``run`` (:data:`RUN_OUTPUTS` and its logs), for
    ``overwrite=true``; anything else in the dir stays."""
    for name in (*RUN_OUTPUTS, *(p.name for p in run.glob("*.log"))):
        victim = run / name
        if victim.is_dir():
            shutil.rmtree(victim)
        elif victim.exists():
            victim.unlink()
