"""Checkpoint files read safely (``weights_only=True``, always) and found for ``resume=``. A
checkpoint file is written by global rank 0 alone (:mod:`.files`); a sharded one by every rank,
each writing its own shards, and rank 0 its ``meta.pt`` and the rename (:mod:`.sharded`).

This module and those two only read and write files; what a checkpoint holds is gathered by
:mod:`ddpexp.training.checkpoint_state` (its docstring documents the schema), the unwrapped
model's weights under ``"model"``. :func:`load`, :func:`~.sharded.load_sharded` (without a
template) and :func:`verify` check a checkpoint's digest before its bytes are unpickled
(where it fails, a file cut off or no archive at all is still named as such).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ddpexp.checkpoint.files import (
    CHECKPOINTS,
    LAST,
    PREVIOUS,
    also_unreadable,
    check_digest,
    corrupt,
    fix_advice,
)
from ddpexp.checkpoint.sharded import META, is_sharded, load_meta, load_sharded
from ddpexp.errors import CheckpointError


def load(path: Path | str, map_location: Any = "cpu", mmap: bool = False,
         fix: str | None = None) -> dict:
    """Read a checkpoint with ``weights_only=True``; anything else is a clear error.

    ``mmap=True`` maps the tensors instead of reading them: the whole (safe) unpickling and
    the archive's structure are still checked, at little cost, which is what :func:`verify`
    uses before a run starts. ``fix`` is what a corrupt file's message advises (default: how
    to resume from another checkpoint)."""
    path = Path(path)
    if is_sharded(path):
        ckpt = load_sharded(path)
        if "model" not in ckpt:
            raise CheckpointError(f"{path} is not a ddpexp checkpoint (no 'model' entry)")
        return ckpt
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        check_digest(path, fix)  # first: before the bytes are parsed at all
    except CheckpointError as changed:
        # The digest says the bytes changed; where they no longer read as an archive
        # either (cut off, garbled), the message says both.
        _check_kind(path, fix, changed)
        _read(path, "cpu", True, fix, changed)
        raise
    _check_kind(path, fix)
    ckpt = _read(path, map_location, mmap, fix)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a ddpexp checkpoint (no 'model' entry)")
    return ckpt


def _read(path: Path, map_location: Any, mmap: bool, fix: str | None,
          changed: CheckpointError | None = None) -> Any:
    """``torch.load(path, weights_only=True)``; what it refuses, as a CheckpointError."""
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except (RuntimeError, OSError):
            if not mmap:
                raise
            # A legacy (non-zip) file cannot be mapped, and a truncated one fails mapping
            # with a bare EINVAL: read it, still weights_only, for the real reason.
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if _REFUSED_OBJECT.search(str(exc)):
            raise CheckpointError(
                f"checkpoint {path} holds objects that only an unsafe pickle load could "
                "create; ddpexp reads checkpoints with torch.load(weights_only=True) only and "
                "refuses it. Re-save it as tensors and plain Python containers."
            ) from None
        raise corrupt(path, exc, fix, changed) from None  # bytes that no pickler wrote
    except (RuntimeError, EOFError, ValueError, OSError, KeyError) as exc:
        raise corrupt(path, exc, fix, changed) from None


# What torch's weights_only unpickler says of a well-formed pickle that would build objects
# other than tensors and containers (a class, a function to call); any other complaint of
# it ("Unsupported operand ...") is about bytes that are no pickle torch.save writes.
_REFUSED_OBJECT = re.compile(
    r"Unsupported global|is blocked|unrecognized function|Can only create new object|"
    r"Can only build|must be imported to load")
# How the files torch.save writes begin: a zip archive, or (the legacy format) a pickle.
_MAGIC = (b"PK\x03\x04", b"\x80")


def _check_kind(path: Path, fix: str | None, changed: CheckpointError | None = None) -> None:
    """Refuse a file that cannot be a checkpoint at all (empty, or bytes that begin as
    neither of torch.save's formats), naming it as such rather than as a torn one."""
    with open(path, "rb") as f:
        head = f.read(16)  # the magic, and enough to recognise text (an HTML error page)
    if not head:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): no checkpoint was "
                              f"written to it. {fix_advice(path, fix)}")
    start = head[:len(_MAGIC[0])]
    if not any(start.startswith(m) or m.startswith(start) for m in _MAGIC):
        size = path.stat().st_size
        what = (f"{path} is not a checkpoint: its {size} bytes begin {head!r}, neither a zip "
                "archive nor a pickle, the formats torch.save writes")
        if changed is not None:
            raise also_unreadable(changed, path, what.split(": ", 1)[1]) from None
        raise CheckpointError(f"{what}. {fix_advice(path, fix)}")


def verify(path: Path | str) -> dict:
    """Check, before any worker starts, that ``path`` loads safely: a corrupt or unsafe file
    then fails the command at once, before the run dir's metrics.json is touched. Its
    digest is checked (a sharded checkpoint's: every file); a sharded checkpoint's
    ``meta.pt`` and index are read, its shards when it loads. Returns what the run's parent
    reads of it: ``config`` (the resolved config it was trained with, None in a checkpoint
    that lacks it), ``epoch`` and ``step``."""
    path = Path(path)
    if path.is_dir():
        if not is_sharded(path):
            raise CheckpointError(f"{path} is a directory, not a checkpoint (a sharded one holds "
                                  f".metadata and {META})")
        check_digest(path)
        state = load_meta(path)
        import torch.distributed.checkpoint as dcp

        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # torch raises what its unpickler or the file system did
            raise corrupt(path / ".metadata", exc) from None
    else:
        state = load(path, mmap=True)
    return {key: state.get(key) for key in ("config", "epoch", "step")}


def checkpoint_dir(run_dir: Path | str) -> Path:
    """Where the run in ``run_dir`` keeps its checkpoints (``last.pt``, ``best.pt``, top-k)."""
    return Path(run_dir) / CHECKPOINTS


def find(resume: str | None, run_dir: Path, base: Path | None = None) -> Path | None:
    """The checkpoint ``resume`` asks for: ``auto`` -> ``run_dir``'s last.pt if any, a run dir
    -> its last.pt, a file -> that file. ``None`` means start from scratch. A relative path is
    taken from ``base`` (where the command was started; Hydra may have moved into the run
    dir since, with ``hydra.job.chdir=true``)."""
    if resume in (None, ""):
        return None
    if resume == "auto":
        return newest_last(checkpoint_dir(run_dir))
    target = Path(resume).expanduser()
    if base is not None and not target.is_absolute():
        target = Path(base) / target
    if not target.exists() and target.name == LAST and newest_last(target.parent):
        return newest_last(target.parent)
    if is_sharded(target):
        return target
    if target.is_dir():
        last = newest_last(checkpoint_dir(target))
        if last is None:
            raise CheckpointError(
                f"resume={resume}: {checkpoint_dir(target) / LAST} does not exist (the run "
                "saved no checkpoint yet)"
            )
        return last
    if target.is_file():
        return target
    raise CheckpointError(
        f"resume={resume} is neither auto, a run dir nor a checkpoint file that exists"
    )


def newest_last(directory: Path) -> Path | None:
    """``directory``'s last.pt, or the one a crash left mid-swap; None if neither."""
    last = directory / LAST
    if last.exists():
        return last
    previous = directory / (LAST + PREVIOUS)
    return previous if is_sharded(previous) or previous.is_file() else None
