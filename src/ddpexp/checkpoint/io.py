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

Every checkpoint this module writes carries the SHA-256 of its bytes, so that a file changed
on disk (a flipped bit, a bad copy, an edit) is refused instead of resumed or evaluated with
other weights: a file's beside it as ``<name>.sha256`` (``last.pt.sha256``), a sharded
directory's inside it as ``SHA256SUMS`` (one line per file), both in the format
``sha256sum -c`` checks. :func:`load`, :func:`load_sharded` (without a template) and
:func:`verify` check it before the bytes are unpickled (where it fails, a file cut off or
no archive at all is still named as such); a checkpoint without one (written by an
earlier version, or copied without it) is read as before. SHA-256 because this machine's
CPUs hash it in hardware, twice as fast as BLAKE2b (docs/benchmarks.md).

The archive's records carry no CRC-32 of their own (:func:`write_archive`): the digest is the
check, and the CRCs were a third of a save's CPU time (docs/benchmarks.md).
``torch.load`` never reads it; ``unzip -t`` and Python's ``zipfile`` report such records
as bad.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # not on Windows: copies there are plain copies
    fcntl = None

import torch

from ddpexp.errors import CheckpointError, naming

LAST, BEST = "last.pt", "best.pt"
CHECKPOINTS = "checkpoints"  # a run dir's checkpoints live in run_dir/CHECKPOINTS
_TMP_MARK = ".tmp-"
META = "meta.pt"  # a sharded checkpoint's non-tensor entries
_PREVIOUS = ".previous"  # a sharded checkpoint being replaced
# The entries of a sharded checkpoint that torch.distributed.checkpoint holds.
SHARDED_KEYS = ("model", "raw_model", "optimizer")
DIGEST_SUFFIX = ".sha256"  # a checkpoint file's digest: last.pt.sha256 beside last.pt
SHARDED_DIGEST = "SHA256SUMS"  # a sharded checkpoint's digests, inside its directory
_DIGEST_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def save_atomic(obj: dict, path: Path) -> None:
    """Write ``obj`` to ``path`` so that a crash at any instant leaves either the old file or
    the new one, never a torn one: temporary file in the same dir, fsync, rename, fsync dir.
    Its SHA-256 is written beside it (:func:`digest_path`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write_archive(obj, f)
            f.flush()
            # The bytes are hashed from the page cache while fsync waits for the disk: the
            # digest costs the save little more than the fsync did (docs/benchmarks.md).
            with ThreadPoolExecutor(max_workers=1) as pool:
                digest = pool.submit(file_digest, tmp)
                os.fsync(f.fileno())
        _swap_into(tmp, path, digest.result())
    except RuntimeError:
        # torch's archive writer reports a short write ("unexpected pos ...", "file write
        # failed", "enforce fail at inline_container.cc") without the errno; a full disk is
        # by far the usual cause. Asked while the partial file still fills it.
        full = _disk_full(path.parent)
        tmp.unlink(missing_ok=True)
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise
    except OSError as exc:  # one that met the full disk on close names no file: this one
        tmp.unlink(missing_ok=True)
        raise naming(exc, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_archive(obj: Any, f: BinaryIO) -> None:
    """``torch.save(obj, f)``, the same archive (``torch.load`` reads it alike) but without the
    CRC-32 of each record, which the SHA-256 beside the file makes redundant: a 1.6 GB
    :func:`save_atomic` took 4.3 s of CPU with the CRCs, 2.9 s without (the median of 3 on
    2 cores, docs/benchmarks.md). ``torch.serialization.set_crc32_options`` is process-wide (a user's own saves would
    lose theirs while one of these ran), so the writer is made here with the flag of its
    own; where torch's internals differ, ``torch.save`` writes it."""
    serialization: Any = torch.serialization
    try:
        writer = torch._C.PyTorchFileWriter(f, False, serialization._get_storage_alignment())
        save = serialization._save
    except (AttributeError, TypeError):
        torch.save(obj, f)
        return
    try:
        save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # An unfinished writer finishes the file when it is destroyed; by then ``f`` is
        # closed, the write raises inside a C++ destructor and the process aborts. Finish
        # it now, while ``f`` is open; the half-written file is the caller's to discard.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


def _swap_into(new: Path, path: Path, digest: str | None = None) -> None:
    """Put ``new`` (a file whose SHA-256 is ``digest``, or a sharded checkpoint's directory)
    at ``path``. A file over a file is one atomic rename. Where a directory is replaced, or
    replaces a file (a run resumed under another strategy), the old one waits as
    ``path.previous`` while the new one is renamed in, so a crash at any instant leaves one
    of them readable (:func:`find` falls back to ``.previous``)."""
    if new.is_file() and not path.is_dir():
        _replace_file(new, path, digest)
        return
    previous = path.with_name(path.name + _PREVIOUS)
    _remove(previous)
    old = digest_path(path)
    if path.is_file() and old.is_file():  # the file waits as .previous with its digest
        _write_digests(digest_path(previous), previous.name, _recorded(old))
    _remove_file(old)  # from here on path is a directory, or the new file
    if path.exists():
        os.replace(path, previous)
    os.replace(new, path)
    if digest is not None:
        _write_digests(old, path.name, [digest])  # a crash before it: read unchecked
    _fsync_dir(path.parent)
    _remove(previous)


def _replace_file(new: Path, path: Path, digest: str | None) -> None:
    """Rename the file ``new`` over the file ``path``, its digest file kept true at every
    instant: while the rename happens the digest file accepts both the old bytes and the
    new, then the new only. A crash therefore never leaves a good file refused."""
    sidecar = digest_path(path)
    if path.is_file() and sidecar.is_file() and digest is not None:
        _write_digests(sidecar, path.name, [*_recorded(sidecar, strict=False), digest])
    else:
        _remove_file(sidecar)  # no record for the new bytes yet: read unchecked meanwhile
    os.replace(new, path)
    if digest is not None:
        _write_digests(sidecar, path.name, [digest])


def digest_path(path: Path | str) -> Path:
    """Where the digest of the checkpoint file ``path`` lives: ``path`` + ``.sha256``."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def file_digest(path: Path | str) -> str:
    """The SHA-256 of the file at ``path``, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_digests(sidecar: Path, name: str, digests: Sequence[str]) -> None:
    """Write ``sidecar`` atomically: one ``sha256sum`` line per digest that ``name`` may have."""
    _write_small(sidecar, "".join(f"{d}  {name}\n" for d in dict.fromkeys(digests)))


def _write_small(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on disk before the checkpoint's rename can be
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_digests(sidecar: Path, strict: bool = True) -> list[tuple[str, str]]:
    """``(hex digest, file name)`` for each line of ``sidecar``. A line that is no
    ``sha256sum`` line is refused (``strict``) or skipped."""
    try:
        lines = sidecar.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        if not strict:
            return []
        raise CheckpointError(f"digest file {sidecar} cannot be read ({exc}); delete it to "
                              "read its checkpoint unchecked") from None
    entries = []
    for line in lines:
        match = _DIGEST_LINE.match(line)
        if match:
            entries.append((match[1], match[2]))
        elif strict and line.strip():
            raise CheckpointError(
                f"digest file {sidecar} is damaged (a line that is no sha256sum line: "
                f"{line[:80]!r}); delete it to read its checkpoint unchecked")
    if strict and not entries:
        raise CheckpointError(f"digest file {sidecar} holds no digest; delete it to read its "
                              "checkpoint unchecked")
    return entries


def _recorded(sidecar: Path, strict: bool = True) -> list[str]:
    return [digest for digest, _ in _read_digests(sidecar, strict)]


def check_digest(path: Path | str, fix: str | None = None) -> None:
    """Refuse the checkpoint at ``path`` (a file, or a sharded directory: every file its
    ``SHA256SUMS`` lists) if its bytes are not the ones saved. One without a digest (written
    by an earlier version) passes. ``fix`` is what the refusal advises (see :func:`load`)."""
    path = Path(path)
    if path.is_dir():
        sums = path / SHARDED_DIGEST
        if not sums.is_file():
            return
        entries = _read_digests(sums)
        missing = [name for _, name in entries if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} "
                                  f"listed in its {SHARDED_DIGEST} missing. {_fix(path, fix)}")
        files = [path / name for _, name in entries]
        # hashlib lets go of the GIL: the shards are hashed side by side.
        with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
            actual = list(pool.map(file_digest, files))
        for (saved, _), file, digest in zip(entries, files, actual, strict=True):
            if digest != saved:
                raise _changed(file, digest, [saved], sums, path, fix)
        return
    sidecar = digest_path(path)
    if not sidecar.is_file():
        return
    saved = _recorded(sidecar)
    digest = file_digest(path)
    if digest not in saved:
        raise _changed(path, digest, saved, sidecar, path, fix)


def _changed(file: Path, digest: str, saved: Sequence[str], sidecar: Path, checkpoint: Path,
             fix: str | None) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {file} changed since it was saved: its SHA-256 is {digest[:16]}..., "
        f"{sidecar.name} recorded {saved[0][:16]}... (damage on disk or in a copy, or an "
        f"edit). {_fix(checkpoint, fix)} If the file is as it should be, delete {sidecar} "
        "to read it unchecked.")


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
        _replace_file(tmp, dst, _copied_digest(src, tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dst.parent)


def _copied_digest(src: Path, copy: Path) -> str | None:
    """The digest of ``copy`` of ``src``: the one ``src`` records (the bytes were copied,
    not read here), hashed afresh only where ``src`` records two (a save cut short); None
    where ``src`` has none."""
    sidecar = digest_path(src)
    if not sidecar.is_file():
        return None
    saved = _recorded(sidecar, strict=False)
    return saved[0] if len(saved) == 1 else file_digest(copy) if saved else None


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


def remove(path: Path | str) -> None:
    """Delete the checkpoint at ``path`` (a file or a sharded directory) and its digest."""
    _remove(Path(path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    _remove_file(digest_path(path))


def _remove_file(path: Path) -> None:
    if path.is_file() or path.is_symlink():
        path.unlink(missing_ok=True)


def is_sharded(path: Path | str) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def save_sharded(tensors: dict, meta: dict | None, path: Path, is_main: bool) -> None:
    """Write a sharded checkpoint at ``path``; every rank calls it with its own shards in
    ``tensors`` (DTensors), global rank 0 also with ``meta``. A crash at any instant leaves
    the previous checkpoint readable (at ``path`` or, mid-rename, ``path.previous``)."""
    import torch.distributed.checkpoint as dcp

    tmp = _empty_sharded_tmp(path, is_main)
    # dcp.save returns once every rank's shards are written.
    _end_sharded(lambda: dcp.save(tensors, checkpoint_id=str(tmp)), tmp, meta, path, is_main)


class HostStaging:
    """Where a background sharded save copies this rank's shards (DCP's stager for
    :func:`start_sharded`): host buffers made at the first save and copied into at each
    later one, while the state's layout (every tensor's place, shape and dtype) stays the
    same. DCP's default stager builds fresh buffers at every save, deep-copying each CPU
    DTensor on the way: on the CPU a 150M-parameter model's save stopped the loop for
    1.6 s, of which the copy was 0.14 s. A buffer is written again only by the next save,
    which starts after this one's write ended (one save in flight). Pinned where the
    state is on a GPU; :meth:`clear` lets go of the buffers."""

    # The copy is done when stage() returns: DCP has nothing to wait for after it.
    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: Any = None
        self._layout: tuple = ()

    def stage(self, state_dict: dict) -> dict:
        from torch.distributed._state_dict_utils import _copy_state_dict

        layout = tuple(_layout(state_dict))
        if self._buffers is None or layout != self._layout:
            self._buffers = None  # the old buffers go before the new ones are made
            self._buffers, self._layout = _host_buffers(state_dict), layout
        return _copy_state_dict(state_dict, self._buffers, type_check=False)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """The buffers are kept for the next save (:meth:`clear` lets go of them)."""

    def clear(self) -> None:
        self._buffers, self._layout = None, ()


def _host_buffers(obj: Any) -> Any:
    """Empty host tensors shaped as those of ``obj`` (a DTensor's: this rank's shard, in a
    DTensor of the same mesh and placements; pinned for a GPU's tensor), in the same
    containers; other values as they are (the copy takes each save's own). Made directly:
    DCP's own ``_create_cpu_state_dict`` deep-copies every CPU DTensor, data included."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if not isinstance(obj, DTensor):
            return torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
        local = obj.to_local()
        buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
        return DTensor.from_local(buffer, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, dict):
        return {key: _host_buffers(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        values = [_host_buffers(value) for value in obj]
        return values if isinstance(obj, list) else tuple(values)
    return obj


def _layout(obj: Any, path: str = "") -> Iterator[tuple]:
    """(path, device, type, shape, local shape, dtype) of every tensor in ``obj``, and the
    path of every container: what must stay the same for staged buffers to be reused."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)  # a DTensor's shard
        yield (path, str(obj.device), type(obj).__name__, tuple(obj.shape),
               tuple(local.shape), obj.dtype)
    elif isinstance(obj, dict):
        yield (path, "dict", len(obj))
        for key, value in obj.items():
            yield from _layout(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        yield (path, type(obj).__name__, len(obj))
        for i, value in enumerate(obj):
            yield from _layout(value, f"{path}/{i}")


def start_sharded(tensors: dict, meta: dict | None, path: Path, is_main: bool, group: Any,
                  before_write: Callable[[], None] | None = None,
                  staging: HostStaging | None = None) -> Callable[[], None]:
    """:func:`save_sharded` in the background (``torch.distributed.checkpoint.async_save``):
    every rank calls it in the loop's thread, at the same point. Each copies its shards to
    host memory before it returns (what is written is the state of this moment), and DCP's
    thread then writes them, its collectives over ``group`` (a process group of its own, so
    that they never meet the loop's on the default group). Returns what completes the save:
    called once in a thread of this rank's, it waits for the write (which returns on every
    rank only once every rank's shards and DCP's metadata are on disk) and on global rank 0
    writes ``meta.pt`` and the digests and renames the directory into place, all without a
    collective; a failed write is raised there, as :func:`save_sharded` raises it.
    ``before_write`` is called in DCP's thread before this rank writes (for tests);
    ``staging``: the host buffers kept from the last save, reused where they fit."""
    import torch.distributed.checkpoint as dcp

    tmp = _empty_sharded_tmp(path, is_main)
    stager: Any = staging if staging is not None else HostStaging()
    future = dcp.async_save(tensors, storage_writer=_hooked_writer(tmp, before_write),
                            process_group=group, async_stager=stager)
    assert isinstance(future, Future)  # staged in this thread: only the write's future
    # On a failure the barrier is the writers' own group's, which nothing else uses then.
    return functools.partial(_end_sharded, future.result, tmp, meta, path, is_main, group)


def _end_sharded(write: Callable[[], Any], tmp: Path, meta: dict | None, path: Path,
                 is_main: bool, group: Any = None) -> None:
    """The end of a sharded save into ``tmp``: ``write()`` returns once every rank's shards
    are on disk, then rank 0 writes ``meta`` and the digests and renames ``tmp`` to ``path``.
    A failed write reaches every rank (each says the same); the shards written so far go
    once every rank has judged them (a barrier over ``group``; the previous checkpoint was
    not touched)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except CheckpointException as exc:
        error = _sharded_save_error(exc, path)
        if dist.is_initialized():
            dist.barrier(group=group)
        if is_main:
            _remove(tmp)
        raise error from None
    if is_main:
        assert meta is not None
        _complete_sharded(tmp, meta, path)


def _hooked_writer(path: Path, before_write: Callable[[], None] | None) -> Any:
    """torch's FileSystemWriter (as ``dcp.save`` makes one) into ``path`` that calls
    ``before_write`` in the writing thread before it writes."""
    writer = _hooked_writer_class()(str(path))
    writer.hook = before_write
    return writer


@functools.cache
def _hooked_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class HookedWriter(FileSystemWriter):
        hook: Callable[[], None] | None = None

        def write_data(self, plan: Any, planner: Any) -> Any:
            if self.hook is not None:
                self.hook()
            return super().write_data(plan, planner)

    return HookedWriter


def _empty_sharded_tmp(path: Path, is_main: bool) -> Path:
    """The temporary directory a sharded checkpoint of ``path`` is written into, empty on
    every rank's return (a barrier: nobody writes into it before rank 0 has emptied it)."""
    import torch.distributed as dist

    tmp = path.with_name(f"{path.name}{_TMP_MARK}sharded")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
    if dist.is_initialized():
        dist.barrier()
    return tmp


def _complete_sharded(tmp: Path, meta: dict, path: Path) -> None:
    """Rank 0's part once every rank's shards are in ``tmp``: meta.pt, the digests, the rename."""
    with open(tmp / META, "wb") as f:
        write_archive(meta, f)
        f.flush()
        os.fsync(f.fileno())
    _write_sharded_digests(tmp)
    _fsync_dir(tmp)
    _swap_into(tmp, path)


def _write_sharded_digests(directory: Path) -> None:
    """``SHA256SUMS`` in the sharded checkpoint ``directory``: every rank's files, once
    every rank has written them (dcp.save has returned), hashed side by side."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != SHARDED_DIGEST)
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_digest, files))
    _write_small(directory / SHARDED_DIGEST,
                 "".join(f"{d}  {p.name}\n" for p, d in zip(files, digests, strict=True)))


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

    if template is None:
        # One process reads it: here it is checked. Every rank of a run reading into its
        # shards was started after verify() checked it.
        check_digest(path)
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
        check_digest(path, fix)  # before the bytes are unpickled
    except CheckpointError:
        _read(path, "cpu", True, fix)  # a cut-off or garbled archive is named as such
        raise
    ckpt = _read(path, map_location, mmap, fix)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a ddpexp checkpoint (no 'model' entry)")
    return ckpt


def _read(path: Path, map_location: Any, mmap: bool, fix: str | None) -> Any:
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
        raise _corrupt(path, exc, fix) from None  # bytes that no pickler wrote
    except (RuntimeError, EOFError, ValueError, OSError, KeyError) as exc:
        raise _corrupt(path, exc, fix) from None


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
        state = _load_meta(path)
        import torch.distributed.checkpoint as dcp

        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # torch raises what its unpickler or the file system did
            raise _corrupt(path / ".metadata", exc) from None
    else:
        state = load(path, mmap=True)
    return {key: state.get(key) for key in ("config", "epoch", "step")}


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
