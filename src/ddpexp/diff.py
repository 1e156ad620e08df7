"""``python -m ddpexp.diff A B [--json]``: what differs between two runs, and on a sweep dir
(``python -m ddpexp.diff SWEEP``) what varies between its jobs.

Sections, each one line where the two runs agree: ``config`` (``key: a -> b``, from
``.hydra/config.yaml``), ``code`` (each repo's commit, branch and dirty flag, and the
difference between the two runs' uncommitted patches, file by file: the changed lines only
one of them has), ``packages``
(``name: a -> b``, Python, torch, CUDA, cuDNN, NCCL and the backend included), ``machine and
environment``, ``data`` (the files read: size and content hash) and ``results`` (status,
epochs, steps, final, best and test metrics of ``metrics.json``). The code, packages,
machine and data sections come from each run's ``provenance.json``
(:mod:`ddpexp.provenance`); a run without one says so in those sections.

Neither torch nor Hydra is imported: a diff prints in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpexp import provenance
from ddpexp.config.resume import flatten
from ddpexp.record import read_metrics_or_empty

SECTIONS = ("config", "code", "packages", "machine and environment", "data", "results")
# Keys of a record that differ between any two runs and say nothing about what made them.
_NOISE = ("written", "collect_s", "resume", "machine.world.restart")
_ABSENT = "(absent)"
# Lines of a patch difference shown per file in text (--json keeps them all).
_PATCH_LINES = 40


class NotARun(ValueError):
    """A path that is no run dir (nor, where one is allowed, a sweep dir)."""


# ---------------------------------------------------------------------------- one run
class Run:
    """What one run dir holds, read once: its config, provenance record and metrics."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.exists():
            raise NotARun(f"{path} does not exist")
        if not self.is_run(self.path):
            raise NotARun(f"{path} is not a run dir (it holds no .hydra/config.yaml, "
                          "metrics.json or provenance.json)")
        self.config = _read_yaml(self.path / ".hydra" / "config.yaml")
        try:
            self.record: dict | None = provenance.read(self.path)
        except (FileNotFoundError, ValueError):
            self.record = None
        self.metrics = read_metrics_or_empty(self.path)

    @staticmethod
    def is_run(path: Path) -> bool:
        """Whether ``path`` is a run dir."""
        return any((path / name).is_file() for name in
                   (".hydra/config.yaml", "metrics.json", provenance.PROVENANCE_FILE))

    def section(self, name: str) -> dict[str, Any] | None:
        """The flat ``{key: value}`` of a section (None: no provenance record to read it
        from); ``code`` is :meth:`code`."""
        if name == "config":
            return flatten(self.config)
        if name == "results":
            return _results(self.metrics)
        if self.record is None:
            return None
        rec = self.record
        if name == "packages":
            return {**{f"{k} (version)": v for k, v in (rec.get("versions") or {}).items()},
                    **(rec.get("packages") or {})}
        if name == "machine and environment":
            flat = flatten({"machine": rec.get("machine") or {}})
            flat.update({f"env.{k}": v for k, v in (rec.get("env") or {}).items()})
            return {k: v for k, v in flat.items() if k not in _NOISE}
        if name == "data":
            return _data(rec.get("data") or {})
        if name == "code":
            return _code_summary(rec)
        raise KeyError(name)

    def patches(self) -> dict[str, dict[str, str]]:
        """``{repo path: {file: its part of the uncommitted patch}}``."""
        out: dict[str, dict[str, str]] = {}
        for repo in ((self.record or {}).get("code") or {}).get("repos") or []:
            out[str(repo.get("path"))] = split_patch(provenance.read_patch(self.path, repo))
        return out


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _results(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: metrics.get(k) for k in ("status", "epochs", "steps", "monitor")
           if k in metrics}
    monitor = metrics.get("monitor")
    best = metrics.get("best") or {}
    if isinstance(best, Mapping) and monitor in best:
        out[f"best.{monitor}"] = best[monitor]
    for part in ("final", "test"):
        values = metrics.get(part) or {}
        if isinstance(values, Mapping):
            out.update({f"{part}.{k}": v for k, v in values.items() if "/" in k})
    return out


def _data(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": data.get("source")}
    package = data.get("package")
    if isinstance(package, Mapping):
        out["package"] = f"{package.get('name')} {package.get('version')}"
    for entry in data.get("files") or []:
        digest = entry.get("sha256") or entry.get("sampled_sha256") or entry.get("error")
        out[f"file {entry.get('path')}"] = f"{entry.get('size')} bytes, sha256 {str(digest)[:12]}"
    return out


def _code_summary(rec: Mapping[str, Any]) -> dict[str, Any]:
    code = rec.get("code") or {}
    out: dict[str, Any] = {}
    for repo in code.get("repos") or []:
        where = repo.get("path")
        for key in ("commit", "branch", "dirty"):
            out[f"{where} {key}"] = repo.get(key)
        for entry in repo.get("untracked") or []:
            out[f"{where} untracked {entry.get('path')}"] = (entry.get("sha256") or "")[:12] \
                or f"{entry.get('size')} bytes"
    own = code.get("ddpexp") or {}
    out["ddpexp version"] = own.get("version")
    if own.get("commit"):
        out["ddpexp commit"] = own.get("commit")
    return out


def split_patch(text: str) -> dict[str, str]:
    """A ``git diff`` output cut into ``{file: its part}``."""
    parts: dict[str, str] = {}
    for chunk in re.split(r"(?m)^(?=diff --git )", text):
        head = re.match(r"diff --git a/(.+?) b/", chunk)
        if head:
            parts[head.group(1)] = chunk
    return parts


# ---------------------------------------------------------------------------- two runs
def changes(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[dict]:
    """``[{"key", "a", "b"}]`` for every key whose values differ (absent on one side
    included)."""
    a, b = a or {}, b or {}
    keys = list(a) + [k for k in b if k not in a]
    return [{"key": k, "a": a.get(k, _ABSENT), "b": b.get(k, _ABSENT)}
            for k in keys if a.get(k, _ABSENT) != b.get(k, _ABSENT)]


def patch_changes(a: Run, b: Run) -> list[dict]:
    """File by file, where the two runs' uncommitted patches differ: ``{"repo", "file",
    "a_only", "b_only"}``, the changed lines (``+``/``-`` lines of the patch) that one run's
    patch of that file has and the other's has not."""
    pa, pb = a.patches(), b.patches()
    out = []
    for repo in list(pa) + [r for r in pb if r not in pa]:
        fa, fb = pa.get(repo, {}), pb.get(repo, {})
        for name in sorted(set(fa) | set(fb)):
            if fa.get(name) == fb.get(name):
                continue
            la, lb = _changed_lines(fa.get(name, "")), _changed_lines(fb.get(name, ""))
            out.append({"repo": repo, "file": name, "a_only": _minus(la, lb),
                        "b_only": _minus(lb, la)})
    return out


def _changed_lines(part: str) -> list[str]:
    return [line for line in part.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))]


def _minus(lines: list[str], other: list[str]) -> list[str]:
    """``lines`` less those ``other`` has (as many times as it has them), in order."""
    left = list(other)
    out = []
    for line in lines:
        if line in left:
            left.remove(line)
        else:
            out.append(line)
    return out


def compare(a: Run, b: Run) -> dict:
    """Every section's differences between ``a`` and ``b`` (what ``--json`` prints)."""
    sections: dict[str, Any] = {}
    for name in SECTIONS:
        sa, sb = a.section(name), b.section(name)
        entry: dict[str, Any] = {"changes": changes(sa, sb)}
        if sa is None or sb is None:
            entry["missing"] = [str(r.path) for r, s in ((a, sa), (b, sb)) if s is None]
        if name == "code":
            entry["patches"] = patch_changes(a, b)
        entry["same"] = not entry["changes"] and not entry.get("patches") and "missing" not in entry
        sections[name] = entry
    return {"a": str(a.path), "b": str(b.path), "sections": sections}


def format_compare(result: Mapping[str, Any]) -> str:
    """The text form of :func:`compare`: each section a line, its differences under it."""
    lines = [f"a: {result['a']}", f"b: {result['b']}"]
    for name, entry in result["sections"].items():
        if entry["same"]:
            lines.append(f"{name}: same")
            continue
        if "missing" in entry:
            lines.append(f"{name}: no provenance.json in {', '.join(entry['missing'])}")
            continue
        n = len(entry["changes"]) + len(entry.get("patches") or [])
        lines.append(f"{name}: {n} difference{'s' if n != 1 else ''}")
        lines += [f"  {c['key']}: {_show(c['a'])} -> {_show(c['b'])}" for c in entry["changes"]]
        for patch in entry.get("patches") or []:
            lines.append(f"  {patch['file']} ({patch['repo']}): the uncommitted changes differ")
            body = [f"a only: {x}" for x in patch["a_only"]] + [f"b only: {x}" for x in patch["b_only"]]
            lines += [f"    {line}" for line in body[:_PATCH_LINES]]
            if len(body) > _PATCH_LINES:
                lines.append(f"    ... {len(body) - _PATCH_LINES} more lines (--json has them all)")
    return "\n".join(lines) + "\n"


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


# ---------------------------------------------------------------------------- a sweep
def sweep_jobs(path: Path) -> list[Path]:
    """The job dirs of a sweep dir (its run dirs, in job order)."""
    found = {p.parent.parent for p in path.glob("*/.hydra/config.yaml")}
    found |= {p.parent for p in path.glob(f"*/{provenance.PROVENANCE_FILE}")}
    return sorted(found, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def compare_sweep(path: Path) -> dict:
    """Per section, the keys whose values vary between the sweep's jobs (with each job's
    value) and the keys every job shares."""
    if not Path(path).exists():
        raise NotARun(f"{path} does not exist")
    jobs = [Run(p) for p in sweep_jobs(path)]
    if len(jobs) < 2:
        raise NotARun(f"{path} is not a sweep dir with two or more jobs (found {len(jobs)})")
    sections: dict[str, Any] = {}
    for name in SECTIONS:
        flat = [job.section(name) or {} for job in jobs]
        keys = list(dict.fromkeys(k for f in flat for k in f))
        varies = {k: {job.path.name: f.get(k, _ABSENT) for job, f in zip(jobs, flat, strict=True)}
                  for k in keys if len({json.dumps(f.get(k, _ABSENT), default=str) for f in flat}) > 1}
        sections[name] = {"varies": varies, "same": [k for k in keys if k not in varies]}
    return {"sweep": str(path), "jobs": [j.path.name for j in jobs], "sections": sections}


def format_sweep(result: Mapping[str, Any], shown: int = 12) -> str:
    """The text form of :func:`compare_sweep`."""
    lines = [f"sweep {result['sweep']}: {len(result['jobs'])} jobs"]
    for name, entry in result["sections"].items():
        same = entry["same"]
        if not entry["varies"]:
            lines.append(f"{name}: same in every job ({len(same)} keys)")
            continue
        lines.append(f"{name}: {len(entry['varies'])} key(s) vary")
        for key, values in entry["varies"].items():
            lines.append(f"  {key}: " + ", ".join(f"{job}={_show(v)}" for job, v in values.items()))
        listed = ", ".join(same[:shown]) + (f", ... ({len(same) - shown} more; --json lists them)"
                                            if len(same) > shown else "")
        lines.append(f"  same in every job ({len(same)}): {listed or 'none'}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpexp.diff A B [--json]``: what differs between run dirs A and B;
    ``python -m ddpexp.diff SWEEP``: what varies between a sweep's jobs."""
    parser = argparse.ArgumentParser(prog="python -m ddpexp.diff", description=main.__doc__)
    parser.add_argument("a", type=Path, help="a run dir (or a sweep dir, alone)")
    parser.add_argument("b", type=Path, nargs="?", help="the run dir to compare it with")
    parser.add_argument("--json", action="store_true", help="print the differences as JSON")
    args = parser.parse_args(argv)
    try:
        if args.b is None:
            if Run.is_run(args.a):
                raise NotARun(f"{args.a} is one run dir: name a second one to compare it with "
                              "(python -m ddpexp.diff A B), or a sweep dir alone")
            result = compare_sweep(args.a)
            text = format_sweep(result)
        else:
            result = compare(Run(args.a), Run(args.b))
            text = format_compare(result)
    except NotARun as exc:
        print(f"ddpexp.diff: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(result, indent=1, default=str) + "\n" if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
