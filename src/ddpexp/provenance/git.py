"""The state of the git repos a run's code came from: commit, branch, dirty flag, the
uncommitted diff of tracked files, the untracked files.

Every git call has a timeout (:data:`GIT_TIMEOUT_S`): a repo on a hung network mount costs
the run a few seconds and a note in the record, never the run. Two calls per repo at most:
``git status`` (commit, branch, changes, untracked files in one) and, where the tree is
dirty, ``git diff HEAD``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

GIT_TIMEOUT_S = 5.0
# Untracked files listed per repo, and the largest one whose content is hashed: past either,
# the record says which cap was hit.
MAX_UNTRACKED = 200
MAX_HASHED_BYTES = 1 << 20
# The bytes of untracked files hashed per repo in all; the files past it are listed unhashed.
UNTRACKED_BUDGET_BYTES = 16 << 20
# What counts as source among untracked files (data, logs and run outputs do not): files with
# these suffixes outside the dirs where runs and sweeps write (Hydra's defaults and ddpexp's).
OUTPUT_DIRS = frozenset(("outputs", "multirun", ".hydra", "__pycache__"))
SOURCE_SUFFIXES = (".py", ".pyi", ".yaml", ".yml", ".json", ".toml", ".cfg", ".ini", ".txt",
                   ".md", ".sh", ".c", ".cc", ".cpp", ".h", ".cu", ".pyx")


# Porcelain v2: the fields before the path of an ordinary, a renamed and an unmerged entry.
_FIELDS_BEFORE_PATH = {"1 ": 8, "2 ": 9, "u ": 10}


class GitError(RuntimeError):
    """A git call that failed or timed out; the message says which and why."""


def git(cwd: Path | str, *args: str) -> str:
    """``git ARGS`` in ``cwd``: its stdout. :class:`GitError` where git is missing, fails or
    runs past :data:`GIT_TIMEOUT_S`."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise GitError("git is not installed") from None
    except subprocess.TimeoutExpired:
        raise GitError(f"git {args[0]} took over {GIT_TIMEOUT_S:g} s in {cwd}") from None
    except OSError as exc:
        raise GitError(f"git {args[0]} in {cwd}: {exc}") from None
    if done.returncode != 0:
        raise GitError(f"git {args[0]} in {cwd}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout.decode(errors="surrogateescape")


def repo_root(path: Path | str) -> Path | None:
    """The top of the git work tree that holds ``path`` (a file or a dir), or None."""
    path = Path(path)
    where = path if path.is_dir() else path.parent
    # Most files are in no repo: a walk up for .git is cheaper than a git process each.
    for parent in (where, *where.parents):
        if (parent / ".git").exists():
            return parent.resolve()
    return None


def repo_state(root: Path, with_patch: bool = True) -> tuple[dict, str]:
    """The record of the repo at ``root`` and (``with_patch``) its uncommitted diff of
    tracked files (``git diff HEAD``, text; empty for a clean tree)."""
    record: dict = {"path": str(root)}
    try:
        status = git(root, "status", "--porcelain=v2", "--branch", "-z", "--untracked-files=all")
    except GitError as exc:
        record["error"] = str(exc)
        return record, ""
    changed, untracked = [], []
    for entry in status.split("\0"):
        if entry.startswith("# branch.oid "):
            oid = entry.split()[-1]
            record["commit"] = None if oid == "(initial)" else oid
        elif entry.startswith("# branch.head "):
            head = entry.split(" ", 2)[-1]
            record["branch"] = None if head == "(detached)" else head
        elif entry.startswith("? "):
            untracked.append(entry[2:])
        elif entry[:2] in _FIELDS_BEFORE_PATH:
            changed.append(entry.split(" ", _FIELDS_BEFORE_PATH[entry[:2]])[-1])
    record["dirty"] = bool(changed)
    record["changed"] = sorted(changed)
    record.update(untracked_files(root, untracked))
    patch = ""
    if changed and record.get("commit") and with_patch:
        try:
            patch = git(root, "diff", "HEAD", "--binary")
        except GitError as exc:
            record["error"] = str(exc)
    return record, patch


def untracked_files(root: Path, names: list[str]) -> dict:
    """``untracked``: the untracked source files (:data:`SOURCE_SUFFIXES`, outside
    :data:`OUTPUT_DIRS`; path, size, sha256 of each up to
    :data:`MAX_HASHED_BYTES`), at most :data:`MAX_UNTRACKED`; ``untracked_capped``: which
    cap was hit, where one was."""
    sources = sorted(n for n in names if n.endswith(SOURCE_SUFFIXES)
                     and OUTPUT_DIRS.isdisjoint(n.split("/")[:-1]))
    listed, notes, budget = [], [], UNTRACKED_BUDGET_BYTES
    for name in sources[:MAX_UNTRACKED]:
        try:
            size = os.stat(root / name).st_size
        except OSError:
            continue
        entry: dict = {"path": name, "size": size}
        if size > MAX_HASHED_BYTES:
            notes.append(f"{name}: {size} bytes, over {MAX_HASHED_BYTES} (not hashed)")
        elif size > budget:
            notes.append(f"{name}: past {UNTRACKED_BUDGET_BYTES} bytes hashed in all (not hashed)")
        else:
            entry["sha256"] = file_sha256(root / name)
            budget -= size
        listed.append(entry)
    if len(sources) > MAX_UNTRACKED:
        notes.append(f"{len(sources)} untracked source files, the first {MAX_UNTRACKED} listed")
    out: dict = {"untracked": listed}
    if notes:
        out["untracked_capped"] = notes
    return out


def file_sha256(path: Path) -> str | None:
    """The SHA-256 of the file at ``path`` (None where it cannot be read)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()
