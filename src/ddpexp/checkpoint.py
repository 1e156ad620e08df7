"""Checkpoint files: written atomically (by global rank 0 only), read safely
(``weights_only=True``, always), found for ``resume=``.

This module only reads and writes files; what a checkpoint holds is gathered by
:mod:`ddpexp.state` (its docstring documents the schema), the unwrapped model's weights under
``"model"``.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Optional

try:
    import fcntl
except ImportError:  # not on Windows: copies there are plain copies
    fcntl = None  # type: ignore[assignment]

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
    try:
        return shutil.disk_usage(directory).free < need
    except OSError:
        return False


def copy_atomic(src: Path, dst: Path) -> None:
    """Make ``dst`` a file of its own with ``src``'s bytes, atomically (temporary file,
    fsync, rename, fsync dir), without serialising the checkpoint a second time: a
    copy-on-write clone where the file system has them (btrfs, XFS), else a copy made by
    the kernel. Never a hard link: damage to one file (last.pt) must not reach the other
    (best.pt), which is the fallback its error message offers."""
    tmp = dst.with_name(f"{dst.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            _clone_or_copy(fin, fout)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dst.parent)


# ioctl FICLONE (_IOW(0x94, 9, int)): share the source's extents copy-on-write.
_FICLONE = 0x40049409


def _clone_or_copy(fin: BinaryIO, fout: BinaryIO) -> None:
    """``fin``'s bytes into the empty ``fout``: a reflink clone, else ``copy_file_range``
    (in the kernel, itself a clone on some file systems), else a buffered copy."""
    if fcntl is not None:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return
        except OSError:
            pass  # not supported here (ext4, tmpfs, another device): copy instead
    size = os.fstat(fin.fileno()).st_size
    copied = 0
    try:
        while copied < size:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), size - copied)
            if n == 0:
                break
            copied += n
    except (OSError, AttributeError):  # AttributeError: no copy_file_range on this OS
        pass
    if copied != size:
        fin.seek(0)
        fout.seek(0)
        fout.truncate()
        shutil.copyfileobj(fin, fout, 1 << 20)


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
    _check_kind(path, fix)
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
        if _REFUSED_OBJECT.search(str(exc)):
            raise CheckpointError(
                f"checkpoint {path} holds objects that only an unsafe pickle load could "
                "create; ddpexp reads checkpoints with torch.load(weights_only=True) only and "
                "refuses it. Re-save it as tensors and plain Python containers."
            ) from None
        raise _corrupt(path, exc, fix) from None  # bytes that no pickler wrote
    except (RuntimeError, EOFError, ValueError, OSError, KeyError) as exc:
        raise _corrupt(path, exc, fix) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a ddpexp checkpoint (no 'model' entry)")
    return ckpt


# What torch's weights_only unpickler says of a well-formed pickle that would build objects
# other than tensors and containers (a class, a function to call); any other complaint of
# it ("Unsupported operand ...") is about bytes that are no pickle torch.save writes.
_REFUSED_OBJECT = re.compile(
    r"Unsupported global|is blocked|unrecognized function|Can only create new object|"
    r"Can only build|must be imported to load")
# How the files torch.save writes begin: a zip archive, or (the legacy format) a pickle.
_MAGIC = (b"PK\x03\x04", b"\x80")


def _check_kind(path: Path, fix: Optional[str]) -> None:
    """Refuse a file that cannot be a checkpoint at all (empty, or bytes that begin as
    neither of torch.save's formats), naming it as such rather than as a torn one."""
    with open(path, "rb") as f:
        head = f.read(16)  # the magic, and enough to recognise text (an HTML error page)
    if not head:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): no checkpoint was "
                              f"written to it. {_fix(path, fix)}")
    start = head[:len(_MAGIC[0])]
    if not any(start.startswith(m) or m.startswith(start) for m in _MAGIC):
        size = path.stat().st_size
        raise CheckpointError(
            f"{path} is not a checkpoint: its {size} bytes begin {head!r}, neither a zip "
            f"archive nor a pickle, the formats torch.save writes. {_fix(path, fix)}")


def verify(path: Path | str) -> None:
    """Check, before any worker starts, that ``path`` loads safely: a corrupt or unsafe file
    then fails the command at once, before the run dir's metrics.json is touched."""
    load(path, mmap=True)


def _corrupt(path: Path, exc: BaseException, fix: Optional[str] = None) -> CheckpointError:
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]  # past torch's advice to load unsafely
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
        reason = "not a complete checkpoint archive"  # what torch reports for a cut-off file
    return CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason}). {_fix(path, fix)}")


def _fix(path: Path, fix: Optional[str]) -> str:
    """What to do about an unreadable checkpoint: ``fix``, or by default how to resume
    from another one."""
    if fix is not None:
        return fix
    other = path.with_name(BEST if path.name != BEST else LAST)
    alternative = f"another checkpoint (e.g. resume={other})" if other.is_file() else \
        "another checkpoint"
    return f"Point resume= at {alternative}, or start afresh."


def find(resume: Optional[str], run_dir: Path, base: Optional[Path] = None) -> Optional[Path]:
    """The checkpoint ``resume`` asks for: ``auto`` -> ``run_dir``'s last.pt if any, a run dir
    -> its last.pt, a file -> that file. ``None`` means start from scratch. A relative path is
    taken from ``base`` (where the command was started; Hydra may have moved into the run
    dir since, with ``hydra.job.chdir=true``)."""
    if resume in (None, ""):
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / LAST
        return last if last.exists() else None
    target = Path(resume).expanduser()
    if base is not None and not target.is_absolute():
        target = Path(base) / target
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

