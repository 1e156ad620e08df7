"""``python -m ddpexp.eval PATH [overrides]``: evaluate saved checkpoints on a split.

PATH is a run dir (its ``checkpoints/best.pt``), a checkpoint file, or a sweep dir (every
job's ``best.pt``, one row each). Task, model and data are rebuilt from the resolved config
stored in the checkpoint, with the overrides on top (``data.root=...``, ``trainer.procs=2``,
``split=val``; ``split=test`` by default). The whole split is evaluated, whatever the training
run's ``trainer.limit_val_batches`` (``trainer.limit_val_batches=N`` here limits it), and the
table says how many samples were. Evaluation is the trainer's own sharded
:meth:`~ddpexp.training.trainer.Trainer.evaluate_checkpoint`, run through the same fan-out as a
training run (:func:`ddpexp.launch.fanout.dispatch`), so each sample counts exactly once whatever
the number of workers and the numbers match the ``test/<name>`` the run recorded. Each
evaluation is also written to ``eval-<time>.json`` in its run dir.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from ddpexp.checkpoint import files as ckpt_files
from ddpexp.checkpoint import io as ckpt_io
from ddpexp.checkpoint import sharded as ckpt_sharded
from ddpexp.config import components
from ddpexp.config.schema import for_evaluation, trainer_of
from ddpexp.errors import CheckpointError, ConfigError, DdpexpError
from ddpexp.modes.evaluate import Evaluate
from ddpexp.strategies import registry

SPLITS = ("test", "val")
# The config groups of a training command line (model=mlp), which an evaluation cannot pick:
# it rebuilds what the checkpoint was trained with.
_GROUPS = ("task", "model", "data", "optimizer", "scheduler", "trainer", "callbacks", "logger",
           "experiment", "debug")
USAGE = ("usage: python -m ddpexp.eval PATH [key=value ...]  "
         "(PATH: a run dir, a checkpoint file or a sweep dir)")


def targets(path: Path) -> list[tuple[str, Path, Path]]:
    """``(name, run dir, checkpoint)`` for each checkpoint ``path`` stands for."""
    from ddpexp.report import run_dirs

    path = Path(path)
    if path.is_file() or ckpt_sharded.is_sharded(path):  # a file, or an fsdp run's sharded last.pt
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return [(run_dir.name, run_dir, path)]
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist: give a run dir, a checkpoint file or a sweep dir")
    own = path / "checkpoints" / ckpt_files.BEST
    dirs = run_dirs(path)
    if own.exists() or dirs == [path]:
        return [(path.name, path, own)]
    if not dirs:
        raise CheckpointError(f"{path} holds no run dirs (no .hydra/config.yaml or metrics.json under it)")
    return [(str(d.relative_to(path)), d, d / "checkpoints" / ckpt_files.BEST) for d in dirs]


def _another_checkpoint(checkpoint: Path) -> str:
    """What to evaluate instead of an unreadable ``checkpoint``: the run's other checkpoints
    beside it that exist (never the same file), or nothing to point at."""
    first = {"best.pt": 0, "last.pt": 1}
    others = [p for p in sorted(checkpoint.parent.glob("*.pt"),
                                key=lambda p: (first.get(p.name, 2), p.name))
              if p.name != checkpoint.name and (p.is_file() or ckpt_sharded.is_sharded(p))]
    if not others:
        return "The run has no other checkpoint beside it to evaluate."
    names = " or ".join(f"python -m ddpexp.eval {p}" for p in others[:2])
    return f"Evaluate another checkpoint of the run: {names}."


def apply_overrides(config: dict, overrides: Sequence[str]) -> tuple[dict, str]:
    """The stored config with ``key=value`` overrides on top, and the split asked for. Keys
    must exist in the config (``+key=value`` adds one), as on the training command line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.create(copy.deepcopy(config))
    split = "test"
    given = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value. {USAGE}")
        if key == "split":
            if value not in SPLITS:
                raise ConfigError(f"split={value} is not one of {', '.join(SPLITS)}")
            split = value
            continue
        add = key.startswith("+")
        key = key.lstrip("+")
        if "." not in key and key in _GROUPS and not value.startswith("{"):
            raise ConfigError(
                f"{item}: an evaluation rebuilds what its checkpoint was trained with (model, "
                f"data, task), so it picks no {key} option ({item} is for training: "
                f"python -m ddpexp {item}). "
                f"It takes keys of the run's config (e.g. data.root=DIR, data.batch_size=256, "
                f"trainer.procs=2), +key=value to add one, and split={'|'.join(SPLITS)}")
        if not add and OmegaConf.select(cfg, key, default=KeyError) is KeyError:
            raise ConfigError(_not_a_key(cfg, key, value))
        try:
            OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"k={value}"]).k, force_add=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item}: {exc}") from None
        given.add(key)
    for_evaluation(cfg, given, registry.is_builtin, registry.AUTO)
    return cast(dict, OmegaConf.to_container(cfg, resolve=True)), split  # a DictConfig's: a dict


def _not_a_key(cfg: Any, key: str, value: str) -> str:
    """Why ``key`` is not in the run's config ``cfg``: the closest key where it would be, or
    how to add it."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    names = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(name, names, n=1)
    add = f"use +{key}={value} to add it"
    if close:
        return (f"{key} is not a key of the run's config; did you mean "
                f"{parent + '.' if parent else ''}{close[0]}? (or {add})")
    return f"{key} is not a key of the run's config; {add}"


def evaluate(run_dir: Path, checkpoint: Path, overrides: Sequence[str] = ()) -> dict:
    """Evaluate one checkpoint; returns what ``eval-<time>.json`` holds and writes that file
    into ``run_dir``."""

    from ddpexp.config.spec import RunSpec
    from ddpexp.launch.fanout import dispatch, plan_run

    sharded = ckpt_sharded.is_sharded(checkpoint)
    if not checkpoint.is_file() and not sharded:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not exist (the run saved no best checkpoint); give "
            "a checkpoint file instead, e.g. its checkpoints/last.pt"
        )
    fix = _another_checkpoint(checkpoint)
    # The config is all this process needs; the workers read the weights.
    state = ckpt_sharded.load_sharded(checkpoint, keys=()) if sharded else ckpt_io.load(checkpoint, fix=fix)
    if not isinstance(state.get("config"), dict) or "trainer" not in state["config"]:
        raise CheckpointError(f"checkpoint {checkpoint} holds no run config to rebuild the model from")
    config, split = apply_overrides(state["config"], overrides)
    del state
    components.check_nodes(config)  # a bad key or _target_ added here: before any worker
    plan = plan_run(trainer_of(config))
    spec = RunSpec.build(config, plan, run_dir=run_dir, log_file=run_dir / "eval.log",
                         mode=Evaluate(checkpoint.absolute(), split))
    result = dispatch(spec)
    if result is None:
        raise CheckpointError(f"checkpoint {checkpoint} vanished before it was read")
    record = {
        "checkpoint": str(checkpoint.absolute()),
        "split": split,
        "epoch": result["epoch"],
        "samples": result["samples"],
        "world_size": plan.world_size,
        # None: the whole split (see apply_overrides)
        "limit_val_batches": spec.trainer.limit_val_batches,
        "overrides": list(overrides),
        "metrics": result["metrics"],
    }
    _write_record(run_dir, record)
    return record


def _write_record(run_dir: Path, record: dict) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = run_dir / f"eval-{stamp}.json"
    n = 1
    while path.exists():  # two evaluations in the same second keep both records
        path, n = run_dir / f"eval-{stamp}-{n}.json", n + 1
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def what_was_evaluated(record: dict) -> str:
    """One line of an evaluation's record: which checkpoint, on what part of which split."""
    limit = record.get("limit_val_batches")
    part = ("the whole split" if limit is None else
            f"its first {limit} batch(es) per worker (trainer.limit_val_batches={limit})")
    return (f"{record['checkpoint']} (epoch {record['epoch']}) on the {record['split']} split: "
            f"{part}, {record['samples']} samples, {record['world_size']} worker(s)")


def format_table(rows: Sequence[tuple[str, dict | None, str | None]]) -> str:
    """Aligned text: one row per ``(name, record or None, error or None)``."""
    names: list[str] = []
    for _, record, _ in rows:
        for k in (record or {}).get("metrics", {}):
            if k not in names:
                names.append(k)
    titles = ["run", "split", "epoch", *names, "samples", "workers", "error"]
    cells = []
    for name, record, error in rows:
        r = record or {}
        metrics = r.get("metrics", {})
        cells.append([name, str(r.get("split", "")), str(r.get("epoch", "")),
                      *(f"{metrics[k]:.4f}" if k in metrics else "" for k in names),
                      str(r.get("samples", "")), str(r.get("world_size", "")), error or ""])
    if not any(c[-1] for c in cells):
        titles, cells = titles[:-1], [c[:-1] for c in cells]
    widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
    lines = ["  ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Evaluate, print the table; exit 1 with one message per checkpoint that could not be
    evaluated (no traceback unless ``HYDRA_FULL_ERROR=1``)."""
    from ddpexp.config.cli import env_flag

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "\n\n").split("\n\n", 1)[1], file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    path, overrides = Path(args[0]), args[1:]
    rows: list[tuple[str, dict | None, str | None]] = []
    try:
        found = targets(path)
    except DdpexpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, run_dir, checkpoint in found:
        try:
            rows.append((name, evaluate(run_dir, checkpoint, overrides), None))
        except DdpexpError as exc:
            if env_flag("HYDRA_FULL_ERROR"):
                raise
            if len(found) == 1:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            rows.append((name, None, str(exc).splitlines()[0]))
    sys.stdout.write(format_table(rows))
    for name, record, _ in rows:
        if record is not None:
            print(f"{name}: {what_was_evaluated(record)}")
    failed = [name for name, record, _ in rows if record is None]
    if failed:
        print(f"error: {len(failed)} of {len(rows)} checkpoints could not be evaluated: "
              f"{', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
