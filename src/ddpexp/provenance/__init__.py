"""What made a run: ``provenance.json`` (and ``code.patch`` beside it) in every run dir.

Global rank 0 writes it before the first step (:func:`write`): the code (for each git repo
the run's code came from: the working dir's, each ``--config-dir``'s and each ``_target_``
module's outside site-packages: commit, branch, dirty flag, the uncommitted diff as a patch
file, the untracked source files; ddpexp's own version and commit), the packages (every
installed distribution; Python, torch, CUDA, cuDNN, NCCL; the process group's backend), the
machine (host, CPU, GPUs, the world and how it was started, thread settings, the environment
variables that change numerics), the data (:mod:`ddpexp.provenance.data`), the command line
as typed and the resolved config's hash. A resumed run keeps its first record and adds
``provenance-resume-N.json`` (N = 1, 2, ...) for each resume.

Cheap enough for every run: stdlib only at import, two git calls per repo (each with a
timeout), package versions read from the ``.dist-info`` dir names rather than their
metadata files. ``ddpexp.diff`` and ``ddpexp.rerun`` read it (:func:`read`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ddpexp
from ddpexp.provenance import git
from ddpexp.provenance.data import data_record
from ddpexp.record import replace_text

PROVENANCE_FILE = "provenance.json"
PATCH_FILE = "code.patch"
SCHEMA = 1
# The environment variables that change numerics or collectives, recorded with the machine.
ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
             "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED")
ENV_PREFIXES = ("NCCL_", "TORCH_")
# Modules of these packages are no user's code: _target_ paths into them are not followed.
_OWN_PACKAGES = ("ddpexp", "torch", "torchvision", "hydra", "omegaconf", "torchmetrics")


def file_name(resume: int = 0) -> str:
    """``provenance.json``, or ``provenance-resume-N.json`` for the Nth resume."""
    return PROVENANCE_FILE if not resume else f"provenance-resume-{resume}.json"


def read(run_dir: Path | str, resume: int = 0) -> dict:
    """What ``run_dir``'s record holds. ``FileNotFoundError`` where there is none;
    ``ValueError`` (naming the file) where it is no record."""
    path = Path(run_dir) / file_name(resume)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no provenance record")
    return data


def read_patch(run_dir: Path | str, repo: Mapping[str, Any]) -> str:
    """The uncommitted diff saved for ``repo`` (an entry of the record's ``code.repos``)."""
    name = repo.get("patch")
    if not name:
        return ""
    try:
        return (Path(run_dir) / name).read_text(errors="surrogateescape")
    except OSError:
        return ""


def next_resume(run_dir: Path) -> int:
    """0 where ``run_dir`` has no record yet, else the number of the next resume's."""
    if not (run_dir / PROVENANCE_FILE).exists():
        return 0
    n = 1
    while (run_dir / file_name(n)).exists():
        n += 1
    return n


def config_hash(config: Mapping[str, Any]) -> str:
    """The SHA-256 of the resolved config (as sorted JSON)."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write(run_dir: Path, *, config: Mapping[str, Any], source: Any, ctx: Any,
          origin: Mapping[str, Any], backend: str | None) -> Path:
    """Collect the record of this run and write it (and its patch files) into ``run_dir``,
    each file atomically; the record's path. A resumed run's record goes beside the first
    one (:func:`next_resume`)."""
    started = time.perf_counter()
    resume = next_resume(run_dir)
    packages = installed_packages()
    repos, patches = code_repos(config, origin, resume)
    record = {
        "schema": SCHEMA,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resume": resume,
        "command": command(origin),
        "config_hash": config_hash(config),
        "code": {"repos": repos, "ddpexp": ddpexp_code(repos)},
        "packages": packages,
        "versions": versions(backend),
        "machine": machine(ctx, origin),
        "env": numerics_env(),
        "data": data_record(source, packages),
    }
    for name, text in patches.items():
        replace_text(run_dir / name, text, errors="surrogateescape")
    record["collect_s"] = round(time.perf_counter() - started, 3)
    path = run_dir / file_name(resume)
    replace_text(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def command(origin: Mapping[str, Any]) -> dict:
    """The command as typed (``argv``, and as one shell line), where it ran, and this job's
    own overrides (those of a sweep's job differ from the sweep's command)."""
    argv = list(origin.get("argv") or [])
    return {
        "argv": argv,
        "line": shlex.join(["python", "-m", "ddpexp", *argv]),
        "cwd": origin.get("cwd") or os.getcwd(),
        "job_overrides": list(origin.get("job_overrides") or []),
        "config_dirs": list(origin.get("config_dirs") or []),
        "mode": origin.get("mode", "run"),
        "executable": origin.get("executable") or sys.executable,
    }


# ---------------------------------------------------------------------------- code
def code_repos(config: Mapping[str, Any], origin: Mapping[str, Any],
               resume: int = 0) -> tuple[list[dict], dict[str, str]]:
    """Each repo the run's code came from (the working dir's first) with why it counts
    (``roles``), and the patch files to write: the first repo's is ``code.patch`` (written
    even when empty), another's ``code-<repo dir name>.patch`` where its tree is dirty."""
    found: dict[Path, list[str]] = {}
    cwd = origin.get("cwd") or os.getcwd()
    candidates = [(Path(cwd), "cwd")]
    candidates += [(Path(d), "config-dir") for d in origin.get("config_dirs") or []]
    candidates += [(path, f"_target_ {name}") for name, path in target_modules(config)]
    for path, role in candidates:
        root = git.repo_root(path)
        if root is not None and role not in found.setdefault(root, []):
            found[root].append(role)
    prefix = "code" if not resume else f"code-resume-{resume}"
    repos, patches, names = [], {}, set()
    for i, (root, roles) in enumerate(found.items()):
        record, patch = git.repo_state(root)
        record["roles"] = roles
        if i == 0:
            name = f"{prefix}.patch"
        elif patch:
            name = _unique(f"{prefix}-{re.sub(r'[^A-Za-z0-9_.-]', '_', root.name)}", names)
        else:
            name = None
        if name:
            names.add(name)
            patches[name] = patch
        record["patch"] = name
        record["patch_sha256"] = hashlib.sha256(patch.encode(errors="surrogateescape")).hexdigest() \
            if patch else None
        repos.append(record)
    return repos, patches


def _unique(stem: str, taken: set[str]) -> str:
    name, n = f"{stem}.patch", 2
    while name in taken or name == "code.patch":
        name, n = f"{stem}-{n}.patch", n + 1
    return name


def target_modules(config: Any) -> list[tuple[str, Path]]:
    """The source file of each module a ``_target_`` of ``config`` names (as imported in this
    process; nothing is imported here), outside site-packages and the standard library."""
    out: dict[str, Path] = {}
    for target in _targets(config):
        module = _loaded_module(target)
        if module is None or module.__name__.split(".")[0] in _OWN_PACKAGES:
            continue
        where = getattr(module, "__file__", None)
        if where and not _installed(where):
            out.setdefault(module.__name__, Path(where))
    return sorted(out.items())


def _targets(node: Any) -> list[str]:
    if isinstance(node, Mapping):
        found = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        for value in node.values():
            found += _targets(value)
        return found
    if isinstance(node, (list, tuple)):
        return [t for value in node for t in _targets(value)]
    return []


def _loaded_module(target: str) -> Any:
    """The longest prefix of the dotted path ``target`` that is a loaded module."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is not None:
            return module
    return None


def _installed(path: str) -> bool:
    """Whether ``path`` belongs to an installed package or to Python itself."""
    if "site-packages" in path or "dist-packages" in path:
        return True
    return any(path.startswith(p + os.sep) for p in {sys.base_prefix, sys.prefix})


def ddpexp_code(repos: list[dict]) -> dict:
    """ddpexp's own version, where it is imported from and, where that is a git checkout (an
    editable install), its commit, branch and dirty flag."""
    package = Path(ddpexp.__file__).parent
    out: dict[str, Any] = {"version": ddpexp.__version__, "path": str(package),
                           "editable": not _installed(str(package))}
    root = git.repo_root(package) if out["editable"] else None
    if root is not None:
        same = next((r for r in repos if r.get("path") == str(root)), None)
        state = same or git.repo_state(root, with_patch=False)[0]
        out.update({k: state.get(k) for k in ("commit", "branch", "dirty")}, repo=str(root))
    return out


# ---------------------------------------------------------------------------- packages
def installed_packages() -> dict[str, str]:
    """``{name: version}`` of every distribution on ``sys.path``, names normalised (``-``
    and ``.`` as ``_``, lower case). Read from the ``.dist-info``/``.egg-info`` dir names:
    ~1 ms, where ``importlib.metadata`` parses every METADATA file (0.2-0.3 s here)."""
    out: dict[str, str] = {}
    for entry in sys.path:
        try:
            listing = os.scandir(entry or ".")
        except OSError:
            continue
        with listing:
            for item in listing:
                if item.name.endswith((".dist-info", ".egg-info")):
                    name, _, version = item.name.rsplit(".", 1)[0].partition("-")
                    out.setdefault(name.replace("-", "_").replace(".", "_").lower(), version)
    return dict(sorted(out.items()))


def versions(backend: str | None) -> dict:
    """Python, torch, CUDA, cuDNN and NCCL versions, and the process group's backend."""
    import torch

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            import torch.cuda.nccl

            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": cudnn, "nccl": nccl,
            "backend": backend or "none (one process)"}


# ---------------------------------------------------------------------------- machine
def machine(ctx: Any, origin: Mapping[str, Any]) -> dict:
    """Host, CPU, GPUs, the world and how it was started, thread settings."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_mib": props.total_memory >> 20,
                         "capability": f"{props.major}.{props.minor}"})
    per_node = max(1, int(ctx.local_world_size))
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "usable": usable},
        "gpus": gpus,
        "gpu_driver": _gpu_driver() if gpus else None,
        "world": {"launcher": origin.get("launcher", "ddpexp"), "ranks": int(ctx.world_size),
                  "ranks_per_node": per_node, "nodes": max(1, int(ctx.world_size) // per_node),
                  "restart": int(getattr(ctx, "restart", 0))},
        "threads": {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads()},
    }


def numerics_env() -> dict[str, str]:
    """The environment variables that change numerics or collectives (:data:`ENV_NAMES`,
    :data:`ENV_PREFIXES`)."""
    return {k: v for k, v in sorted(os.environ.items())
            if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_driver() -> str | None:
    """The NVIDIA driver's version, from the kernel module (no process started)."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    found = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", first)
    return found.group(1) if found else first
