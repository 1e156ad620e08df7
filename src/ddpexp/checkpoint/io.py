"""Checkpoint files: written atomically, read safely (``weights_only=True``, always), found
for ``resume=``. A checkpoint file is written by global rank 0 alone; a sharded one (below) by
every rank, each writing its own shards, and rank 0 its ``meta.pt`` and the rename.

This module only reads and writes files; what a checkpoint holds is gathered by
:mod:`ddpexp.training.checkpoint_state` (its docstring documents the schema), the unwrapped
model's weights under ``"model"``.

A checkpoint is one file, or (``last.pt`` of a ``strategy=fsdp`` run) a sharded directory:
torch.distributed.checkpoint's files, each rank's shards of the weights and the optimizer
state written by that rank, plus ``meta.pt`` (everything else, one ``torch.save`` file). Such a
directory is written under a temporary name and renamed into place; while the rename happens
the previous one waits beside it as ``last.pt.previous``, which :func:`find` falls back to.
A file that replaces such a directory (a run resumed under another strategy), or the reverse,
is swapped in the same way.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # not on Windows: copies there are plain copies
    fcntl = None

import torch

from ddpexp.errors import CheckpointError

LAST, BEST = "last.pt", "best.pt"
CHECKPOINTS = "checkpoints"  # a run dir's checkpoints live in run_dir/CHECKPOINTS
_TMP_MARK = ".tmp-"
META = "meta.pt"  # a sharded checkpoint's non-tensor entries
_PREVIOUS = ".previous"  # a sharded checkpoint being replaced
# The entries of a sharded checkpoint that torch.distributed.checkpoint holds.
SHARDED_KEYS = ("model", "raw_model", "optimizer")


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
        _swap_into(tmp, path)
    except RuntimeError:
        # torch's archive writer reports a short write ("unexpected pos ...", "file write
        # failed", "enforce fail at inline_container.cc") without the errno; a full disk is
        # by far the usual cause. Asked while the partial file still fills it.
        full = _disk_full(path.parent)
        tmp.unlink(missing_ok=True)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _swap_into(new: Path, path: Path) -> None:
    """Put ``new`` (a file, or a sharded checkpoint's directory) at ``path``. A file over a
    file is one atomic rename. Where a directory is replaced, or replaces a file (a run
    resumed under another strategy), the old one waits as ``path.previous`` while the new
    one is renamed in, so a crash at any instant leaves one of them readable (:func:`find`
    falls back to ``.previous``)."""
    if new.is_file() and not path.is_dir():
        os.replace(new, path)
        return
    previous = path.with_name(path.name + _PREVIOUS)
    _remove(previous)
    if path.exists():
        os.replace(path, previous)
    os.replace(new, path)
    _fsync_dir(path.parent)
    _remove(previous)


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
                _remove(p)
                removed.append(p)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def is_sharded(path: Path | str) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def save_sharded(tensors: dict, meta: dict | None, path: Path, is_main: bool) -> None:
    """Write a sharded checkpoint at ``path``; every rank calls it with its own shards in
    ``tensors`` (DTensors), global rank 0 also with ``meta``. A crash at any instant leaves
    the previous checkpoint readable (at ``path`` or, mid-rename, ``path.previous``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = path.with_name(f"{path.name}{_TMP_MARK}sharded")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
    if dist.is_initialized():
        dist.barrier()  # nobody writes into the temporary dir before it is empty
    try:
        dcp.save(tensors, checkpoint_id=str(tmp))  # returns once every rank's shards are written
    except CheckpointException as exc:
        # Every rank gets every rank's failure, so each says the same; the shards written so
        # far go once every rank has judged them (the previous checkpoint was not touched).
        error = _sharded_save_error(exc, path)
        if dist.is_initialized():
            dist.barrier()
        if is_main:
            _remove(tmp)
        raise error from None
    if not is_main:
        return
    with open(tmp / META, "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _swap_into(tmp, path)


def _sharded_save_error(exc: Any, path: Path) -> BaseException:
    """What a failed ``dcp.save`` means, as the single-file save says it: a full disk (the
    usual cause) is ``OSError(ENOSPC)`` naming ``path``; another OS error keeps its errno."""
    failures = [failure for failure, _ in exc.failures.values()]
    os_errors = [e for e in failures if isinstance(e, OSError) and e.errno is not None]
    full = any(e.errno == errno.ENOSPC for e in os_errors) or (
        # torch's archive writer reports a short write without the errno (see save_atomic)
        any(isinstance(e, RuntimeError) for e in failures) and _disk_full(path.parent))
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if os_errors:
        return OSError(os_errors[0].errno, os_errors[0].strerror, str(path))
    first = failures[0] if failures else exc
    return RuntimeError(f"saving the sharded checkpoint {path} failed: "
                        f"{type(first).__name__}: {first}")


def load_sharded(path: Path, keys: Sequence[str] = ("model", "raw_model"),
                 template: dict | None = None) -> dict:
    """A sharded checkpoint's ``meta.pt`` entries plus its tensors. With ``template``
    (every rank of the run that reads it, each passing its own shards: DTensors or whole
    tensors), the tensors are read into it, resharded to this run's layout; without, this
    process alone reads ``keys`` as whole tensors on the CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    meta = _load_meta(path)
    if template is not None:
        dcp.load(template, checkpoint_id=str(path))
        return {**meta, **template}
    # torch's loader without a template: the tensors of ``keys`` as the metadata describes
    # them, whole, read by this process alone (no process group needed).
    tensors: dict = {}
    _load_state_dict(state_dict=tensors, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
    return {**meta, **tensors}


def _load_meta(path: Path) -> dict:
    meta_file = path / META
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise _corrupt(meta_file, exc) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a ddpexp checkpoint ({META} holds no dict)")
    return meta


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


def _check_kind(path: Path, fix: str | None) -> None:
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
    then fails the command at once, before the run dir's metrics.json is touched. A
    sharded checkpoint's ``meta.pt`` and index are read; its shards are read when it loads."""
    path = Path(path)
    if path.is_dir():
        if not is_sharded(path):
            raise CheckpointError(f"{path} is a directory, not a checkpoint (a sharded one holds "
                                  f".metadata and {META})")
        _load_meta(path)
        import torch.distributed.checkpoint as dcp

        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # torch raises what its unpickler or the file system did
            raise _corrupt(path / ".metadata", exc) from None
        return
    load(path, mmap=True)


def _corrupt(path: Path, exc: BaseException, fix: str | None = None) -> CheckpointError:
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]  # past torch's advice to load unsafely
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
        reason = "not a complete checkpoint archive"  # what torch reports for a cut-off file
    return CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason}). {_fix(path, fix)}")


def _fix(path: Path, fix: str | None) -> str:
    """What to do about an unreadable checkpoint: ``fix``, or by default how to resume
    from another one."""
    if fix is not None:
        return fix
    other = path.with_name(BEST if path.name != BEST else LAST)
    alternative = f"another checkpoint (e.g. resume={other})" if other.is_file() else \
        "another checkpoint"
    return f"Point resume= at {alternative}, or start afresh."


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
    previous = directory / (LAST + _PREVIOUS)
    return previous if is_sharded(previous) or previous.is_file() else None
