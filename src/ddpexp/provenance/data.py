"""Fingerprints of the data a run read: each file's path, size, mtime and a content hash
(the whole file up to :data:`FULL_HASH_BYTES`, else :data:`SAMPLES` evenly spread blocks of
it and its size), so that a changed file shows without reading a whole dataset again."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

FULL_HASH_BYTES = 8 << 20
SAMPLES, SAMPLE_BYTES = 16, 64 << 10
# Files fingerprinted per dataset (an image folder may hold millions), and the bytes read to
# hash them in all; past either, the record says so (past the second, files are listed with
# size and mtime only).
MAX_FILES = 2000
HASH_BUDGET_BYTES = 64 << 20


def fingerprint(path: Path, hash_it: bool = True) -> dict:
    """One file's fingerprint: ``path``, ``size``, ``mtime`` and (with ``hash_it``)
    ``sha256`` (of the whole file) or ``sampled_sha256`` (of sampled blocks, with how
    many)."""
    try:
        st = path.stat()
    except OSError as exc:
        return {"path": str(path), "error": exc.strerror or str(exc)}
    entry: dict[str, Any] = {"path": str(path), "size": st.st_size, "mtime": st.st_mtime}
    if not hash_it:
        return entry
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            if st.st_size <= FULL_HASH_BYTES:
                digest.update(f.read())
                entry["sha256"] = digest.hexdigest()
            else:
                step = (st.st_size - SAMPLE_BYTES) // (SAMPLES - 1)
                for i in range(SAMPLES):
                    f.seek(i * step)
                    digest.update(f.read(SAMPLE_BYTES))
                entry["sampled_sha256"] = digest.hexdigest()
                entry["samples"] = f"{SAMPLES} x {SAMPLE_BYTES} bytes"
    except OSError as exc:
        entry["error"] = exc.strerror or str(exc)
    return entry


def files_under(paths: list[Path]) -> tuple[list[Path], str | None]:
    """The files of ``paths`` (files as they are, dirs walked in sorted order), at most
    :data:`MAX_FILES`; the note to record where that cap was hit."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            for top, dirs, names in os.walk(path):
                dirs.sort()
                found.extend(Path(top) / n for n in sorted(names))
                if len(found) > MAX_FILES:
                    break
        elif path.exists():
            found.append(path)
        if len(found) > MAX_FILES:
            return found[:MAX_FILES], f"over {MAX_FILES} files: the first {MAX_FILES} fingerprinted"
    return found, None


def data_record(source: Any, packages: dict[str, str]) -> dict:
    """What the run's data was: the source's class, the files it read (``source.data_files()``)
    fingerprinted, and for data that ships with a package (``source.ships_with``) or is made
    by code (no files), that package and its version."""
    cls = type(source)
    record: dict[str, Any] = {"source": f"{cls.__module__}.{cls.__qualname__}"}
    files_of = getattr(source, "data_files", None)
    listed = files_of() if callable(files_of) else None
    paths = [Path(p) for p in listed] if isinstance(listed, (list, tuple)) else []
    package = getattr(source, "ships_with", None) or (None if paths else _package_of(cls))
    if package:
        record["package"] = {"name": package, "version": packages.get(_norm(package))}
    if paths:
        files, note = files_under(paths)
        record["files"], budget = [], HASH_BUDGET_BYTES
        for path in files:
            entry = fingerprint(path, hash_it=budget > 0)
            size = int(entry.get("size") or 0)
            budget -= size if size <= FULL_HASH_BYTES else SAMPLES * SAMPLE_BYTES
            record["files"].append(entry)
        notes = [note] if note else []
        if budget <= 0 and any("size" in e and "sha256" not in e and "sampled_sha256" not in e
                               for e in record["files"]):
            notes.append(f"over {HASH_BUDGET_BYTES >> 20} MiB read: the files after it not hashed")
        if notes:
            record["files_capped"] = "; ".join(notes)
    return record


def _package_of(cls: type) -> str:
    """The top-level package of the module that defines ``cls``."""
    top = cls.__module__.split(".")[0]
    return top if top in sys.modules else cls.__module__


def _norm(name: str) -> str:
    """A distribution name as its ``.dist-info`` dir spells it."""
    return name.replace("-", "_").replace(".", "_").lower()
