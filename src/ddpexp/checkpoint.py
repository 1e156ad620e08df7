"""Checkpoint files: written atomically (by global rank 0 only), read safely
(``weights_only=True``, always), found for ``resume=``.

This module only reads and writes files; what a checkpoint holds is the trainer's
``state_dict()`` (its docstring documents the schema), which holds the unwrapped model's
weights under ``"model"``.
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from ddpexp.errors import CheckpointError

LAST, BEST = "last.pt", "best.pt"
_TMP_MARK = ".tmp-"


def save_atomic(obj: dict, path: Path) -> None:
    """Write ``obj`` to ``path`` so that a crash at any instant leaves either the old file or
    the new one, never a torn one: temporary file in the same dir, fsync, rename, fsync dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except RuntimeError as exc:
        tmp.unlink(missing_ok=True)
        # torch's archive writer reports a short write ("unexpected pos ...", "file write
        # failed") without the errno; a full disk is by far the usual cause.
        if _disk_full(path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _disk_full(directory: Path, need: int = 1 << 20) -> bool:
    """Whether less than ``need`` bytes are free where ``directory`` lives."""
    import shutil

    try:
        return shutil.disk_usage(directory).free < need
    except OSError:
        return False


def link_atomic(src: Path, dst: Path) -> None:
    """Make ``dst`` the same file as ``src`` (a hard link renamed into place), atomically and
    without serialising the checkpoint a second time."""
    tmp = dst.with_name(f"{dst.name}{_TMP_MARK}{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        tmp.unlink(missing_ok=True)
        import shutil

        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete temporaries left by a save that was killed; they are never read."""
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if _TMP_MARK in p.name:
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def load(path: Path | str, map_location: Any = "cpu", mmap: bool = False,
         fix: Optional[str] = None) -> dict:
    """Read a checkpoint with ``weights_only=True``; anything else is a clear error.

    ``mmap=True`` maps the tensors instead of reading them: the whole (safe) unpickling and
    the archive's structure are still checked, at little cost, which is what :func:`verify`
    uses before a run starts. ``fix`` is what a corrupt file's message advises (default: how
    to resume from another checkpoint)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        try:
            ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except (RuntimeError, OSError):
            if not mmap:
                raise
            # A legacy (non-zip) file cannot be mapped, and a truncated one fails mapping
            # with a bare EINVAL: read it, still weights_only, for the real reason.
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise CheckpointError(
                f"checkpoint {path} holds objects that only an unsafe pickle load could "
                "create; ddpexp reads checkpoints with torch.load(weights_only=True) only and "
                "refuses it. Re-save it as tensors and plain Python containers."
            ) from None
        raise _corrupt(path, exc, fix) from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError) as exc:
        raise _corrupt(path, exc, fix) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a ddpexp checkpoint (no 'model' entry)")
    return ckpt


def verify(path: Path | str) -> None:
    """Check, before any worker starts, that ``path`` loads safely: a corrupt or unsafe file
    then fails the command at once, before the run dir's metrics.json is touched."""
    load(path, mmap=True)


def _corrupt(path: Path, exc: BaseException, fix: Optional[str] = None) -> CheckpointError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
        reason = "not a complete checkpoint archive"  # what torch reports for a cut-off file
    if fix is None:
        other = path.with_name(BEST if path.name != BEST else LAST)
        alternative = f"another checkpoint (e.g. resume={other})" if other.is_file() else \
            "another checkpoint"
        fix = f"Point resume= at {alternative}, or start afresh."
    return CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason}). {fix}")


def find(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint ``resume`` asks for: ``auto`` -> ``run_dir``'s last.pt if any, a run dir
    -> its last.pt, a file -> that file. ``None`` means start from scratch."""
    if resume in (None, ""):
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / LAST
        return last if last.exists() else None
    target = Path(resume).expanduser()
    if target.is_dir():
        last = target / "checkpoints" / LAST
        if not last.exists():
            raise CheckpointError(
                f"resume={resume}: {last} does not exist (the run saved no checkpoint yet)"
            )
        return last
    if target.is_file():
        return target
    raise CheckpointError(
        f"resume={resume} is neither auto, a run dir nor a checkpoint file that exists"
    )
