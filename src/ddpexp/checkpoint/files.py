"""Checkpoint files on disk, below what they hold: written atomically (a temporary file,
fsync, rename; a crash at any instant leaves the previous file readable), copied
(reflinked where the file system can), removed, and each carrying the SHA-256 of its bytes,
so that a file changed on disk (a flipped bit, a bad copy, an edit) is refused instead of
resumed or evaluated with other weights: a file's beside it as ``<name>.sha256``
(``last.pt.sha256``), a sharded directory's inside it as ``SHA256SUMS`` (one line per file),
both in the format ``sha256sum -c`` checks. A checkpoint without one (written by an earlier
version, or copied without it) is read as before. SHA-256 because this machine's CPUs hash it
in hardware, twice as fast as BLAKE2b (docs/benchmarks.md).

The archive's records carry no CRC-32 of their own (:func:`write_archive`): the digest is the
check, and the CRCs were a third of a save's CPU time (docs/benchmarks.md).
``torch.load`` never reads it; ``unzip -t`` and Python's ``zipfile`` report such records
as bad.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import re
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
TMP_MARK = ".tmp-"
PREVIOUS = ".previous"  # a sharded checkpoint being replaced
DIGEST_SUFFIX = ".sha256"  # a checkpoint file's digest: last.pt.sha256 beside last.pt
SHARDED_DIGEST = "SHA256SUMS"  # a sharded checkpoint's digests, inside its directory
_DIGEST_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def save_atomic(obj: dict, path: Path) -> None:
    """Write ``obj`` to ``path`` so that a crash at any instant leaves either the old file or
    the new one, never a torn one: temporary file in the same dir, fsync, rename, fsync dir.
    Its SHA-256 is written beside it (:func:`digest_path`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write_archive(obj, f)
            f.flush()
            # The bytes are hashed from the page cache while fsync waits for the disk: the
            # digest costs the save little more than the fsync did (docs/benchmarks.md).
            with ThreadPoolExecutor(max_workers=1) as pool:
                digest = pool.submit(file_digest, tmp)
                os.fsync(f.fileno())
        swap_into(tmp, path, digest.result())
    except RuntimeError:
        # torch's archive writer reports a short write ("unexpected pos ...", "file write
        # failed", "enforce fail at inline_container.cc") without the errno; a full disk is
        # by far the usual cause. Asked while the partial file still fills it.
        full = disk_full(path.parent)
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
    fsync_dir(path.parent)


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


def swap_into(new: Path, path: Path, digest: str | None = None) -> None:
    """Put ``new`` (a file whose SHA-256 is ``digest``, or a sharded checkpoint's directory)
    at ``path``. A file over a file is one atomic rename. Where a directory is replaced, or
    replaces a file (a run resumed under another strategy), the old one waits as
    ``path.previous`` while the new one is renamed in, so a crash at any instant leaves one
    of them readable (:func:`find` falls back to ``.previous``)."""
    if new.is_file() and not path.is_dir():
        _replace_file(new, path, digest)
        return
    previous = path.with_name(path.name + PREVIOUS)
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
    fsync_dir(path.parent)
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
    write_small(sidecar, "".join(f"{d}  {name}\n" for d in dict.fromkeys(digests)))


def write_small(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
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
                                  f"listed in its {SHARDED_DIGEST} missing. {fix_advice(path, fix)}")
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
        f"edit). {fix_advice(checkpoint, fix)} If the file is as it should be, delete {sidecar} "
        "to read it unchecked.")


def disk_full(directory: Path, need: int = 1 << 20) -> bool:
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
    tmp = dst.with_name(f"{dst.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            _clone_or_copy(fin, fout)
            fout.flush()
            os.fsync(fout.fileno())
        _replace_file(tmp, dst, _copied_digest(src, tmp))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)


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


def fsync_dir(directory: Path) -> None:
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
            if TMP_MARK in p.name:
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


def corrupt(path: Path, exc: BaseException, fix: str | None = None,
            changed: CheckpointError | None = None) -> CheckpointError:
    """The refusal of a checkpoint that does not read (``exc``, what the reader raised);
    with ``changed``, the refusal of its digest (:func:`check_digest`), which the message
    then gives as well: the bytes changed since the save, whatever they read as now."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]  # past torch's advice to load unsafely
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
        reason = "not a complete checkpoint archive"  # what torch reports for a cut-off file
    if changed is not None:
        return also_unreadable(changed, path, f"truncated or corrupt: {reason}")
    return CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason}). {fix_advice(path, fix)}")


def also_unreadable(changed: CheckpointError, path: Path, why: str) -> CheckpointError:
    """The digest's refusal of ``path`` (:func:`check_digest`), saying too that its bytes no
    longer read as a checkpoint (``why``): the digest is what tells that they changed."""
    text, mark = str(changed), "changed since it was saved"
    if mark not in text:
        return changed
    return CheckpointError(text.replace(mark, f"{mark} and no longer reads as one ({why})", 1))


def fix_advice(path: Path, fix: str | None) -> str:
    """What to do about an unreadable checkpoint: ``fix``, or by default how to resume
    from another one."""
    if fix is not None:
        return fix
    other = path.with_name(BEST if path.name != BEST else LAST)
    alternative = f"another checkpoint (e.g. resume={other})" if other.is_file() else \
        "another checkpoint"
    return f"Point resume= at {alternative}, or start afresh."
