"""``python -m ddpexp.rerun RUN [overrides] [--force] [--in-worktree]``: run RUN's recorded
command again, and say whether it ended with the same metrics.

First the current code, packages and data are checked against RUN's ``provenance.json``:
each recorded repo's commit, its uncommitted patch and untracked files, every package's
version, Python's and torch's, and each data file's size and content hash. A mismatch is
listed and refused unless ``--force``. Then the recorded command runs (its ``--config-dir``
and other flags, the job's own overrides, then ``overrides``) in the recorded working dir,
into a new run dir beside the others (``outputs/rerun/<date>/<time>``; ``hydra.run.dir=``
among ``overrides`` picks another); at the end its metrics are compared with RUN's, bit for
bit. ddpexp runs on the CPU are deterministic for a seed, so a rerun there reproduces them.

``--in-worktree`` builds the code first: the recorded commit of the working dir's repo is
checked out into a scratch ``git worktree``, the recorded patch applied and the recorded
untracked files copied in (each only where its content is still the recorded one), and the
command runs there (config dirs inside that repo are read from the worktree too); the
worktree is removed afterwards. Relative data paths are read from the worktree then: record
data by absolute paths to rerun that way. Where that repo holds ddpexp itself (the run's
ddpexp was an editable install of it), the worktree's ddpexp is what runs, its ``conf/``
included: the command runs in a process of its own with the worktree's source first on
``sys.path``, and a rerun whose record says its ddpexp came from anywhere else is refused.

Otherwise the run happens in this process, as ``python -m ddpexp`` would do it, with the recorded
numerics environment variables and, where the run had fewer, as many cores as it had (a
sweep job's slice): its threads are then the recorded run's.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddpexp import provenance
from ddpexp.diff import Run, changes, split_patch
from ddpexp.provenance import git
from ddpexp.provenance.data import fingerprint
from ddpexp.record import read_metrics_or_empty

# Overrides of the recorded job that the rerun does not repeat: where it writes, and the
# resume of the recorded run (a rerun starts from scratch).
_NOT_REPEATED = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "resume")
# The flags whose value is a path (moved into the worktree with --in-worktree), and the
# others that take the next word as their value.
_PATH_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp")
_VALUE_FLAGS = (*_PATH_FLAGS, "--config-name", "-cn", "--package", "-p")
# What must be equal between the two runs' metrics.json for a rerun to have reproduced.
_COMPARED = ("status", "epochs", "steps", "final", "best", "test")


class Refused(RuntimeError):
    """The rerun cannot start as asked; the message says why."""


# ---------------------------------------------------------------------------- checks
def check(record: Mapping[str, Any], run_dir: Path, in_worktree: bool = False) -> list[str]:
    """What differs now from what ``record`` (``run_dir``'s provenance) says made the run:
    one line per mismatch of code, packages, Python/torch versions and data."""
    problems = []
    repos = (record.get("code") or {}).get("repos") or []
    for i, repo in enumerate(repos):
        if in_worktree and i == 0:
            problems += _worktree_problems(repo)
        else:
            problems += _code_problems(repo, run_dir)
    now = provenance.installed_packages()
    for c in changes(record.get("packages"), now):
        problems.append(f"package {c['key']}: recorded {c['a']}, installed {c['b']}")
    # torch's version is among the packages; Python's is not.
    recorded = (record.get("versions") or {}).get("python")
    if recorded not in (None, platform.python_version()):
        problems.append(f"python: recorded {recorded}, running {platform.python_version()}")
    for entry in (record.get("data") or {}).get("files") or []:
        problems += _data_problems(entry)
    world = (record.get("machine") or {}).get("world") or {}
    if world.get("launcher", "ddpexp") != "ddpexp":
        problems.append(f"world: {world.get('ranks')} rank(s) that {world.get('launcher')} started; "
                        "this rerun would be ddpexp's own fan-out of the recorded config: rerun "
                        f"under {world.get('launcher')} with its command "
                        f"({(record.get('command') or {}).get('line')})")
    return problems


def _code_problems(repo: Mapping[str, Any], run_dir: Path) -> list[str]:
    root = Path(str(repo.get("path")))
    if not root.is_dir():
        return [f"code: repo {root} is gone"]
    state, patch = git.repo_state(root)
    if "error" in state:
        return [f"code: {state['error']}"]
    out = []
    if state.get("commit") != repo.get("commit"):
        out.append(f"code: {root} is at commit {_short(state.get('commit'))}, the run was at "
                   f"{_short(repo.get('commit'))}")
    saved = split_patch(provenance.read_patch(run_dir, repo))
    current = split_patch(patch)
    for name in sorted(set(saved) | set(current)):
        if saved.get(name) != current.get(name):
            how = ("changed since the run" if name in saved and name in current else
                   "uncommitted change not in the run" if name in current else
                   "the run's uncommitted change is not in the tree")
            out.append(f"code: {root / name}: {how}")
    now = {e["path"]: e for e in state.get("untracked") or []}
    for entry in repo.get("untracked") or []:
        here = now.get(entry["path"])
        # Compared by content where the record hashed it, else by size.
        key = "sha256" if entry.get("sha256") else "size"
        if here is None or here.get(key) != entry.get(key):
            out.append(f"code: untracked {root / entry['path']} "
                       f"{'is gone' if entry['path'] not in now else 'changed since the run'}")
    return out


def _worktree_problems(repo: Mapping[str, Any]) -> list[str]:
    """What stops the repo's code being rebuilt from the record: a repo or commit that is
    gone, a recorded untracked file whose content is no longer the recorded one."""
    root, commit = Path(str(repo.get("path"))), repo.get("commit")
    if not commit:
        return [f"code: {root}: the run recorded no commit to check out"]
    try:
        git.git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    except git.GitError:
        return [f"code: {root} has no commit {_short(commit)} to check out"]
    return [f"code: untracked {root / e['path']} changed since the run (it is copied into the "
            "worktree)" for e in repo.get("untracked") or []
            if git.file_sha256(root / e["path"]) != e.get("sha256")]


def _data_problems(entry: Mapping[str, Any]) -> list[str]:
    path = Path(str(entry.get("path")))
    now = fingerprint(path)
    if "error" in now:
        return [f"data: {path}: {now['error']}"]
    for key in ("size", "sha256", "sampled_sha256"):  # what the record holds of the file
        if key in entry and entry[key] != now.get(key):
            return [f"data: {path} changed since the run ({key} differs)"]
    return []


def _short(commit: Any) -> str:
    return str(commit)[:12] if commit else "none"


# ---------------------------------------------------------------------------- the command
def command_args(record: Mapping[str, Any], overrides: Sequence[str],
                 moved: tuple[Path, Path] | None = None) -> list[str]:
    """The recorded command line to run again: its flags (``--config-dir`` and the like;
    paths under ``moved[0]`` moved under ``moved[1]``), the job's own overrides less where it
    wrote and what it resumed, then ``overrides``."""
    cmd = record.get("command") or {}
    argv = list(cmd.get("argv") or [])
    flags: list[str] = []
    flag_of_value = None
    for arg in argv:
        if flag_of_value is not None:
            path = flag_of_value in _PATH_FLAGS
            flags.append(_moved(arg, moved, cmd.get("cwd")) if path else arg)
            flag_of_value = None
            continue
        if arg.startswith("-") and arg not in ("-m", "--multirun"):
            key, eq, value = arg.partition("=")
            if eq and key in _PATH_FLAGS:
                arg = f"{key}={_moved(value, moved, cmd.get('cwd'))}"
            flags.append(arg)
            flag_of_value = arg if arg in _VALUE_FLAGS else None
    job = [o for o in cmd.get("job_overrides") or []
           if o.split("=", 1)[0].lstrip("+~") not in _NOT_REPEATED]
    return [*flags, *job, *overrides]


def _moved(value: str, moved: tuple[Path, Path] | None, cwd: str | None) -> str:
    if moved is None:
        return value
    path = Path(value) if Path(value).is_absolute() else Path(cwd or ".") / value
    try:
        return str(moved[1] / path.resolve().relative_to(moved[0]))
    except ValueError:
        return value


def new_run_dir(base: Path) -> Path:
    """``base/outputs/rerun/<date>/<time>``, with ``-N`` where that dir exists already."""
    stem = base / "outputs" / "rerun" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    path, n = stem, 1
    while path.exists():
        path, n = stem.with_name(f"{stem.name}-{n}"), n + 1
    return path


@contextmanager
def worktree(repo: Mapping[str, Any], run_dir: Path) -> Iterator[Path]:
    """A scratch ``git worktree`` of ``repo`` at its recorded commit, the recorded patch
    applied and the recorded untracked files copied in; removed on leaving."""
    root = Path(str(repo["path"]))
    where = Path(tempfile.mkdtemp(prefix="ddpexp-rerun-")) / root.name
    try:
        git.git(root, "worktree", "add", "--detach", str(where), str(repo["commit"]))
    except git.GitError as exc:
        shutil.rmtree(where.parent, ignore_errors=True)
        raise Refused(f"cannot make a worktree of {root}: {exc}") from None
    try:
        patch = run_dir / str(repo.get("patch") or "")
        if repo.get("patch") and patch.is_file() and patch.stat().st_size:
            try:
                git.git(where, "apply", "--binary", "--whitespace=nowarn", str(patch.resolve()))
            except git.GitError as exc:
                raise Refused(f"the recorded patch {patch} does not apply to commit "
                              f"{_short(repo['commit'])}: {exc}") from None
        for entry in repo.get("untracked") or []:
            target = where / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / entry["path"], target)
        yield where
    finally:
        try:
            git.git(root, "worktree", "remove", "--force", str(where))
        except git.GitError:
            pass
        shutil.rmtree(where.parent, ignore_errors=True)


@contextmanager
def recorded_environment(record: Mapping[str, Any]) -> Iterator[list[str]]:
    """The recorded run's numerics environment variables (:data:`ddpexp.provenance.ENV_NAMES`,
    ``NCCL_*``, ``TORCH_*``: set as recorded, unset where the run had none) and, where it could
    use fewer cores than this process (a sweep job's slice), that many of them (the threads
    per worker follow): what a sweep job's rerun needs to reproduce it. Yields what it
    changed, as words to print; everything is put back on leaving."""
    env = dict(record.get("env") or {})
    now = provenance.numerics_env()
    saved = dict(os.environ)
    changed = [f"{k}={v}" for k, v in env.items() if now.get(k) != v]
    changed += [f"{k} unset" for k in now if k not in env]
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    usable = ((record.get("machine") or {}).get("cpu") or {}).get("usable")
    try:
        for key in now:
            os.environ.pop(key, None)
        os.environ.update(env)
        if affinity is not None and isinstance(usable, int) and 0 < usable < len(affinity):
            os.sched_setaffinity(0, sorted(affinity)[:usable])
            changed.append(f"{usable} of {len(affinity)} cores")
        yield changed
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


def run_here(args: Sequence[str], cwd: Path) -> int:
    """``python -m ddpexp ARGS`` in this process, in ``cwd`` (its modules importable, as
    ``python -m`` makes them); its exit status. The working dir, ``sys.path`` and
    ``sys.argv`` are put back afterwards."""
    from ddpexp.__main__ import checked_main

    before = (os.getcwd(), list(sys.path), list(sys.argv))
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))
    sys.argv = ["ddpexp", *args]
    try:
        checked_main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(before[0])
        sys.path[:], sys.argv[:] = before[1], before[2]


def own_source(record: Mapping[str, Any], repo: Mapping[str, Any], where: Path) -> Path | None:
    """Where ddpexp's own code lies in ``where``, the worktree of ``repo``, when the recorded
    run imported ddpexp from that repo (an editable install): the directory to put first on
    ``sys.path``. None where its ddpexp came from elsewhere (an installed package, which the
    package check compares instead)."""
    code = (record.get("code") or {}).get("ddpexp") or {}
    if not code.get("editable") or code.get("repo") != repo.get("path"):
        return None
    package = Path(str(code["path"]))
    try:
        inside = where / package.relative_to(str(repo["path"]))
    except ValueError:
        return None
    if not (inside / "__init__.py").is_file():
        raise Refused(f"the run imported ddpexp from {package}, which the worktree of commit "
                      f"{_short(repo['commit'])} does not hold")
    return inside.parent


def run_apart(args: Sequence[str], cwd: Path, source: Path) -> int:
    """``python -m ddpexp ARGS`` in a process of its own, in ``cwd``, importing ddpexp (and
    Hydra's plugins beside it) from ``source`` before anything installed; its exit status."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(source), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "ddpexp", *args], cwd=cwd, env=env).returncode


def ran_from(run_dir: Path) -> str | None:
    """Where the run in ``run_dir`` imported ddpexp from, as its record says."""
    try:
        return str(((provenance.read(run_dir).get("code") or {}).get("ddpexp") or {}).get("path"))
    except (FileNotFoundError, ValueError):
        return None


def same_results(a: Path, b: Path) -> list[str]:
    """Where the metrics of runs ``a`` and ``b`` differ (``key: a -> b``; none: the same
    bit for bit)."""
    ma, mb = read_metrics_or_empty(a), read_metrics_or_empty(b)
    return [f"{c['key']}: {c['a']!r} -> {c['b']!r}" for c in
            changes(Run(a).section("results") if ma else {},
                    Run(b).section("results") if mb else {})
            if c["key"].split(".", 1)[0] in _COMPARED]


# ---------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpexp.rerun RUN [overrides] [--force] [--in-worktree]``: run RUN's
    recorded command again after checking code, packages and data against its record."""
    parser = argparse.ArgumentParser(prog="python -m ddpexp.rerun", description=main.__doc__)
    parser.add_argument("run", type=Path, help="the run dir (or sweep job dir) to run again")
    parser.add_argument("overrides", nargs="*", help="overrides added to the recorded ones")
    parser.add_argument("--force", action="store_true",
                        help="run even where code, packages or data differ from the record")
    parser.add_argument("--in-worktree", action="store_true",
                        help="check the recorded commit plus patch out into a scratch git worktree "
                             "and run there")
    args = parser.parse_args(argv)
    run_dir = args.run.absolute()
    if not run_dir.exists():
        print(f"ddpexp.rerun: {args.run} does not exist", file=sys.stderr)
        return 2
    try:
        record = provenance.read(run_dir)
    except FileNotFoundError:
        print(f"ddpexp.rerun: {args.run} holds no {provenance.PROVENANCE_FILE} (not a run dir, or "
              "one written before runs recorded their provenance)", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"ddpexp.rerun: {exc}", file=sys.stderr)
        return 2
    repos = (record.get("code") or {}).get("repos") or []
    if args.in_worktree and not repos:
        print(f"ddpexp.rerun: {args.run} records no git repo to check out (--in-worktree)",
              file=sys.stderr)
        return 2
    problems = check(record, run_dir, args.in_worktree)
    if problems:
        listed = "\n".join(f"  {p}" for p in problems)
        if not args.force:
            print(f"ddpexp.rerun: the code, packages or data differ from {args.run}'s record:\n"
                  f"{listed}\nRestore them (or use --in-worktree for the code), or rerun anyway "
                  "with --force", file=sys.stderr)
            return 1
        print(f"ddpexp.rerun: --force: running although\n{listed}", file=sys.stderr)
    cwd = Path(str((record.get("command") or {}).get("cwd") or os.getcwd()))
    named = [o.split("=", 1)[1] for o in args.overrides if o.split("=", 1)[0] == "hydra.run.dir"]
    target = cwd / named[-1] if named else new_run_dir(cwd)
    extra = [*args.overrides, *([] if named else [f"hydra.run.dir={target}"])]
    try:
        with recorded_environment(record) as changed:
            if changed:
                print(f"ddpexp.rerun: as the run had it: {', '.join(changed)}", file=sys.stderr)
            if args.in_worktree:
                with worktree(repos[0], run_dir) as where:
                    moved = (Path(str(repos[0]["path"])), where)
                    inside = Path(_moved(str(cwd), moved, None))
                    source = own_source(record, repos[0], where)
                    if source is None:
                        code = run_here(command_args(record, extra, moved), inside)
                    else:
                        code = run_apart(command_args(record, extra, moved), inside, source)
                        used = ran_from(target)
                        if code == 0 and used != str(source / "ddpexp"):
                            raise Refused(f"the rerun imported ddpexp from {used}, not from the "
                                          f"worktree's {source / 'ddpexp'}: it did not run the "
                                          "recorded code")
            else:
                code = run_here(command_args(record, extra), cwd)
    except Refused as exc:
        print(f"ddpexp.rerun: {exc}", file=sys.stderr)
        return 1
    if code != 0:
        return code
    differ = same_results(run_dir, target)
    if differ:
        print(f"ddpexp.rerun: {target} did not reproduce {args.run}:\n"
              + "\n".join(f"  {d}" for d in differ), file=sys.stderr)
        return 1
    print(f"ddpexp.rerun: {target} reproduced {args.run}: status, epochs, steps, final, best "
          "and test metrics identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
