"""Tables of runs: one row per run dir, read from what the run left on disk.

The sweep launcher writes ``summary.csv`` / ``summary.md`` with this module and prints the
same table; ``python -m ddpexp.report DIR`` (``ddpexp-report DIR``) prints it for any sweep
dir, single run dir or ``outputs/`` tree. The API is small so that other tools (plots,
TensorBoard HParams) can build on the same rows::

    rows = collect(sweep_dir)            # list[Row], best first
    print(format_rows(rows, "text"))     # or "md", "csv", "json"
    groups = group_seeds(rows)           # list[Group]: runs that differ only in seed
    print(format_groups(groups, "text")) # n, mean and std of final, best and test metrics
    write_summary(sweep_dir, rows)       # summary.csv/md (+ summary_by_seed.csv/md)

Everything is read from each run dir's ``metrics.json`` (written by ddpexp's trainer:
status, epochs, steps, ``final``/``best``/``test`` metrics, ``monitor``/``monitor_mode``, wall
time, ``error``), ``.hydra/overrides.yaml`` and the ``seed`` of ``.hydra/config.yaml``. A
run dir without ``metrics.json`` still gets a row (status ``no metrics``), so a job that
failed before training is never silently missing.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ddpexp import provenance
from ddpexp.record import METRICS_FILE, UnreadableRecord, read_metrics, replace_text

FORMATS = ("text", "md", "csv", "json")
NO_METRICS = "no metrics"
# Columns of every format, in order (csv/json use the field names, text/md the titles).
COLUMNS = ("job", "overrides", "apart", "status", "final", "best", "test", "epochs", "steps",
           "wall_time_s", "error")


@dataclass
class Row:
    """One run (a sweep job or a single run) as the summary shows it."""

    job: str
    overrides: list[str] = field(default_factory=list)
    status: str = NO_METRICS
    monitor: str | None = None
    monitor_mode: str = "max"
    final: float | None = None
    best: float | None = None
    # The monitored metric on the test split, from best.pt (test/acc for val/acc).
    test: float | None = None
    epochs: int | None = None
    steps: int | None = None
    # The run's wall time, start-up included (a sweep job's from the launcher's start of its
    # process); train_time_s is the training loop's part of it.
    wall_time_s: float | None = None
    train_time_s: float | None = None
    error: str | None = None
    dir: str | None = None
    # The final validation metrics and the test metrics, whatever the task names them
    # ({"val/mse": .., "test/mse": .., ...}).
    metrics: dict = field(default_factory=dict)
    seed: int | None = None
    # What set the run apart from the others beyond its overrides, from the runs'
    # provenance.json: "dirty tree", "commit 1a2b3c4d", "host gpu7", ... (see set_apart).
    apart: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Plain values, overrides joined by spaces, one key per final metric (what csv and
        json hold)."""
        out = asdict(self)
        out["overrides"] = " ".join(self.overrides)
        out["apart"] = "; ".join(self.apart)
        out.update(out.pop("metrics"))
        return out


# Rows read before, by run dir, with the files they were read from as they were then (see
# read_run): a sweep rewrites its table as each job ends, and re-reading every job's config
# each time would make that cost grow with the sweep.
_read_before: dict[str, tuple[tuple, Row]] = {}


def _files_now(run_dir: Path) -> tuple:
    """What identifies the files a row is read from as they are now: inode (each record is
    written to a new file and renamed over the old), size and mtime, or None if missing."""
    now = []
    for path in (run_dir / METRICS_FILE, run_dir / ".hydra" / "overrides.yaml",
                 run_dir / ".hydra" / "config.yaml"):
        try:
            st = path.stat()
        except OSError:
            now.append(None)
            continue
        now.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(now)


def read_run(run_dir: Path, job: str | None = None) -> Row:
    """The row of one run dir (``job`` names it in the table; default: the dir's name). A
    dir whose files did not change since it was last read is not parsed again."""
    run_dir = Path(run_dir)
    files = _files_now(run_dir)
    before = _read_before.get(str(run_dir))
    if before is not None and before[0] == files:
        row = copy.deepcopy(before[1])
    else:
        row = _read_run(run_dir)
        _read_before[str(run_dir)] = (files, copy.deepcopy(row))
    row.job = job if job is not None else run_dir.name
    return row


def _read_run(run_dir: Path) -> Row:
    row = Row(job=run_dir.name, dir=str(run_dir), overrides=_read_overrides(run_dir),
              seed=_read_seed(run_dir))
    try:
        data = read_metrics(run_dir)
    except FileNotFoundError:
        return row
    except UnreadableRecord as exc:
        row.status, row.error = "unreadable", str(exc)
        return row
    monitor = data.get("monitor")
    if not isinstance(monitor, str):
        monitor = None
    row.status = str(data.get("status", "unknown"))
    row.monitor = monitor
    row.monitor_mode = str(data.get("monitor_mode", "max"))
    row.final = _number(_entry(data, "final", monitor))
    row.best = _number(_entry(data, "best", monitor))
    row.epochs = data.get("epochs")
    row.steps = data.get("steps")
    row.wall_time_s = _number(data.get("wall_time_s"))
    row.train_time_s = _number(data.get("train_time_s"))
    row.error = data.get("error")
    for part in ("final", "test"):
        values = data.get(part) or {}
        if isinstance(values, dict):
            row.metrics.update({k: v for k, v in values.items()
                                if "/" in k and _number(v) is not None})
    row.test = _number(row.metrics.get(test_name(monitor))) if monitor else None
    return row


def test_name(monitor: str) -> str:
    """The test counterpart of a validation metric: ``val/acc`` -> ``test/acc``."""
    return "test/" + monitor.split("/", 1)[1] if monitor.startswith("val/") else monitor


def run_dirs(root: Path) -> list[Path]:
    """Run dirs under ``root`` (``root`` itself if it is one): dirs that hold
    ``.hydra/config.yaml`` or ``metrics.json``. The runs of ``debug=...`` configs, in
    ``root/debug/``, are left out unless asked for (``outputs/debug``)."""
    root = Path(root)
    if _is_run_dir(root):
        return [root]
    found = {p.parent for p in root.rglob(METRICS_FILE)}
    found |= {p.parent.parent for p in root.rglob("config.yaml") if p.parent.name == ".hydra"}
    return sorted((d for d in found if ".hydra" not in d.relative_to(root).parts
                   and d.relative_to(root).parts[:1] != ("debug",)),
                  key=lambda d: _natural_key(d.relative_to(root)))


def collect(root: Path) -> list[Row]:
    """Rows of every run under ``root`` (a sweep dir, a run dir or ``outputs/``), best first.
    A row's ``job`` is its dir relative to ``root`` (the job number in a sweep dir)."""
    root = Path(root)
    rows = [read_run(d, job=str(d.relative_to(root)) if d != root else d.name)
            for d in run_dirs(root)]
    _fill_from_summary(root, rows)
    set_apart(rows)
    return sort_rows(rows)


def set_apart(rows: Sequence[Row]) -> None:
    """Fill each row's ``apart``: where its run's provenance (the working dir's commit and
    uncommitted patch, the host, the packages, the data files) differs from what most of
    the runs had. Runs without a record are left out of the count."""
    facts: list[dict[str, str] | None] = []
    for row in rows:
        try:
            facts.append(_provenance_facts(provenance.read(row.dir or "")))
        except (FileNotFoundError, ValueError):
            facts.append(None)
    known = [f for f in facts if f is not None]
    if len(known) < 2:
        return
    common = {k: statistics.mode([f.get(k, "") for f in known]) for k in known[0]}
    for row, fact in zip(rows, facts, strict=True):
        if fact is not None:
            row.apart = [_apart_label(k, fact, common) for k in common
                         if fact.get(k, "") != common[k]]


def _provenance_facts(record: dict) -> dict[str, str]:
    """The parts of a provenance record that tell runs apart, each as one string."""
    repos = (record.get("code") or {}).get("repos") or [{}]
    first = repos[0]
    patch = json.dumps([first.get("patch_sha256"), first.get("untracked")], sort_keys=True)
    data = (record.get("data") or {}).get("files") or []
    return {
        "commit": str(first.get("commit") or "")[:8],
        "tree": f"{'dirty' if first.get('dirty') else 'clean'}:{patch}",
        "host": str((record.get("machine") or {}).get("host") or ""),
        "packages": json.dumps([record.get("packages"), record.get("versions")], sort_keys=True),
        "data": json.dumps([(f.get("path"), f.get("size"), f.get("sha256") or f.get("sampled_sha256"))
                            for f in data]),
    }


def _apart_label(key: str, fact: dict[str, str], common: dict[str, str]) -> str:
    if key == "tree":
        if not fact["tree"].startswith("dirty"):
            return "clean tree"
        return "other uncommitted changes" if common["tree"].startswith("dirty") else "dirty tree"
    if key in ("commit", "host"):
        return f"{key} {fact[key]}"
    return f"other {key}"


def _fill_from_summary(root: Path, rows: Sequence[Row]) -> None:
    """Give the rows without a record (a sweep job refused before it trained writes none)
    the status and error that the sweep's ``summary.csv`` in ``root`` recorded for them,
    from what the job's process reported."""
    missing = {r.job: r for r in rows if r.status == NO_METRICS}
    try:
        text = (root / "summary.csv").read_text() if missing else ""
    except OSError:
        return
    for saved in csv.DictReader(io.StringIO(text)):
        row = missing.get(saved.get("job") or "")
        if row is not None and saved.get("status") not in (None, "", NO_METRICS):
            row.status, row.error = saved["status"], saved.get("error") or row.error


def sort_rows(rows: Iterable[Row]) -> list[Row]:
    """Best monitored metric first (each row's ``monitor_mode`` says whether larger is
    better); rows without a metric (failed before validating) last, in job order."""
    def key(row: Row) -> tuple:
        if row.best is None:
            return (1, 0.0, _natural_key(Path(row.job)))
        value = -row.best if row.monitor_mode == "max" else row.best
        return (0, value, _natural_key(Path(row.job)))

    return sorted(rows, key=key)


def format_rows(rows: Sequence[Row], fmt: str = "text") -> str:
    """The table in ``fmt``: ``text`` (aligned columns), ``md``, ``csv`` or ``json``."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "json":
        return json.dumps([r.as_dict() for r in rows], indent=2) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        names = [f.name for f in fields(Row) if f.name != "metrics"] + _metric_columns(rows, None)
        writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
        return buf.getvalue()
    columns = _columns(rows)
    varying = _varying_overrides(rows)
    cells = [[_cell(r, c, varying) for c in columns] for r in rows]
    return _render(_titles(rows, columns), cells, fmt)


def _render(titles: Sequence[str], cells: Sequence[Sequence[str]], fmt: str) -> str:
    """A table as markdown (``md``) or aligned text."""
    if fmt == "md":
        lines = ["| " + " | ".join(titles) + " |", "|" + "|".join("---" for _ in titles) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines) + "\n"
    widths = [max(len(t), *(len(row[i]) for row in cells)) if cells else len(t)
              for i, t in enumerate(titles)]
    lines = ["  ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ seeds
@dataclass
class Group:
    """Runs that differ only in ``seed`` (one configuration): how many, which seeds, and
    the mean and sample standard deviation (``None`` for one run) of each metric over the
    runs that have it."""

    overrides: list[str]
    n: int
    seeds: list = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    status: str = ""
    monitor: str | None = None
    monitor_mode: str = "max"
    # column ("final", "best", "test", or a metric name) -> (mean, std, runs that had it)
    stats: dict = field(default_factory=dict)

    @property
    def metrics(self) -> dict:
        return {k: v for k, v in self.stats.items() if "/" in k}

    def as_dict(self) -> dict:
        """Plain values: ``<column>_mean`` and ``<column>_std`` per statistic (csv, json)."""
        out: dict[str, Any] = {"overrides": " ".join(self.overrides), "n": self.n,
                               "seeds": " ".join(map(str, self.seeds)), "status": self.status,
                               "monitor": self.monitor}
        for name, (mean, std, _) in self.stats.items():
            out[f"{name}_mean"], out[f"{name}_std"] = mean, std
        out["jobs"] = " ".join(self.jobs)
        return out


def group_seeds(rows: Sequence[Row]) -> list[Group]:
    """One :class:`Group` per configuration: rows whose overrides are the same once ``seed``
    is left out. Best mean monitored value first."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted(_without_seed(row.overrides))), []).append(row)
    out = []
    for members in groups.values():
        members = sorted(members, key=lambda r: (r.seed is None, r.seed or 0, _natural_key(Path(r.job))))
        first = members[0]
        counts: dict[str, int] = {}
        for r in members:
            counts[r.status] = counts.get(r.status, 0) + 1
        group = Group(
            overrides=_without_seed(first.overrides), n=len(members),
            seeds=[r.seed if r.seed is not None else "?" for r in members],
            jobs=[r.job for r in members], dirs=[r.dir for r in members if r.dir],
            status=", ".join(f"{k} {v}" for k, v in counts.items()),
            monitor=first.monitor, monitor_mode=first.monitor_mode,
        )
        for name in ("final", "best", "test", *_metric_columns(members, first.monitor)):
            values = [v for v in (_value(r, name) for r in members) if v is not None]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else None
                group.stats[name] = (statistics.fmean(values), std, len(values))
        out.append(group)

    def key(g: Group) -> tuple:
        best = g.stats.get("best")
        if best is None:
            return (1, 0.0, _natural_key(Path(g.jobs[0])))
        return (0, -best[0] if g.monitor_mode == "max" else best[0], _natural_key(Path(g.jobs[0])))

    return sorted(out, key=key)


def varies_seed(rows: Sequence[Row]) -> bool:
    """Whether some configuration among ``rows`` ran with more than one seed."""
    return any(len(set(g.seeds)) > 1 for g in group_seeds(rows))


def format_groups(groups: Sequence[Group], fmt: str = "text") -> str:
    """The per-configuration table in ``fmt`` (``mean ± std`` cells in text and md)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    dicts = [g.as_dict() for g in groups]
    if fmt == "json":
        return json.dumps(dicts, indent=2) + "\n"
    if fmt == "csv":
        names: list[str] = []
        for d in dicts:
            names += [k for k in d if k not in names]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(dicts)
        return buf.getvalue()
    stats = ["final", "best", "test", *_metric_columns(groups, _monitor(groups))]
    stats = [c for c in stats if any(c in g.stats for g in groups)]
    varying = _varying_overrides(groups)
    titles = ["overrides", "n", "seeds", "status", *_titles(groups, stats)]
    cells = [[" ".join(o for o in g.overrides if varying is None or o in varying),
              str(g.n), " ".join(map(str, g.seeds)), g.status,
              *(_mean_std(g.stats.get(c), g.n) for c in stats)] for g in groups]
    return _render(titles, cells, fmt)


def _without_seed(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if _key(o) != "seed"]


def own_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` without ``resume=``: it says how a run was continued (a resumed sweep's
    jobs all get ``resume=auto``), not what the run is."""
    return [str(o) for o in overrides if _key(str(o)) != "resume"]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _value(row: Row, name: str) -> float | None:
    return getattr(row, name) if name in ("final", "best", "test") else _number(row.metrics.get(name))


def _mean_std(stat: tuple | None, n: int) -> str:
    if stat is None:
        return ""
    mean, std, count = stat
    text = f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"
    return text if count == n else f"{text} ({count} of {n})"


def write_summary(directory: Path, rows: Sequence[Row]) -> tuple[Path, Path]:
    """Write ``summary.csv`` and ``summary.md`` into ``directory``, and, where some
    configuration ran with several seeds, ``summary_by_seed.csv`` and ``summary_by_seed.md``
    (one row per configuration); returns the paths of the first two."""
    directory = Path(directory)
    csv_path, md_path = directory / "summary.csv", directory / "summary.md"
    replace_text(csv_path, format_rows(rows, "csv"))
    replace_text(md_path, format_rows(rows, "md"))
    if varies_seed(rows):
        groups = group_seeds(rows)
        replace_text(directory / "summary_by_seed.csv", format_groups(groups, "csv"))
        replace_text(directory / "summary_by_seed.md", format_groups(groups, "md"))
    return csv_path, md_path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddpexp.report DIR [--format F]``: print the table of the runs under DIR."""
    parser = argparse.ArgumentParser(prog="ddpexp-report", description=main.__doc__)
    parser.add_argument("dir", type=Path, help="a sweep dir, a run dir or outputs/")
    parser.add_argument("--format", "-f", choices=FORMATS, default="text")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="also draw the runs' validation curves (the monitored metric and val/loss), one line per run")
    parser.add_argument("--group-seeds", action="store_true",
                        help="one row per configuration: runs that differ only in seed, with n and "
                             "the mean and standard deviation of the final, best and test metrics "
                             "(with --plot: the mean curve and a band of one standard deviation)")
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"{args.dir} is not a directory")
    rows = collect(args.dir)
    if not rows:
        print(f"no runs under {args.dir}", file=sys.stderr)
        return 1
    groups = group_seeds(rows) if args.group_seeds else None
    sys.stdout.write(format_groups(groups, args.format) if groups is not None
                     else format_rows(rows, args.format))
    for row in rows:
        if row.status == "unreadable":
            print(f"note: run {row.job} skipped: {row.error}", file=sys.stderr)
    if args.plot is not None:
        try:
            _plot(rows, groups, args.plot)
        except OSError as exc:
            print(f"--plot {args.plot}: cannot write it ({exc.strerror or exc}); pick a path in "
                  "a directory you can write to", file=sys.stderr)
            return 1
    return 0


def _plot(rows: Sequence[Row], groups: Sequence[Group] | None, out: Path) -> None:
    from ddpexp.plot import plot_curves, plot_groups

    monitor = _monitor(rows) or "val/loss"
    tags = [monitor] + (["val/loss"] if monitor != "val/loss" else [])
    if groups is not None:
        varying = _varying_overrides(groups)
        labelled = [(" ".join(o for o in g.overrides if varying is None or o in varying)
                     or "all runs", [Path(d) for d in g.dirs]) for g in groups]
        drawn = plot_groups(labelled, out, tags)
        print(f"wrote {out}: {drawn} configurations, the mean over seeds with a band of one "
              "standard deviation", file=sys.stderr)
        return
    varying = _varying_overrides(rows)
    runs = [(_label(r, varying), Path(r.dir)) for r in rows if r.dir]
    drawn = plot_curves(runs, out, tags)
    print(f"wrote {out}: {drawn} runs, one curve each", file=sys.stderr)


def _label(row: Row, varying: set | None) -> str:
    shown = [o for o in row.overrides if varying is None or o in varying]
    return f"{row.job}: {' '.join(shown)}" if shown else row.job


# ------------------------------------------------------------------------------ helpers
def _is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() or (path / ".hydra" / "config.yaml").is_file()


def _read_overrides(run_dir: Path) -> list[str]:
    # The first .hydra/overrides.yaml is what the run started with (a resume writes
    # .hydra/resume-N/ next to it).
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return own_overrides(data or [])


def _read_seed(run_dir: Path) -> int | None:
    """The run's ``seed`` as its resolved config says (an override or the config's own)."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    try:
        seed = (yaml.safe_load(path.read_text()) or {}).get("seed")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _entry(data: dict, section: str, monitor: str | None) -> Any:
    """``data[section][monitor]`` where both exist and ``data[section]`` is a mapping."""
    node = data.get(section)
    return node.get(monitor) if monitor and isinstance(node, dict) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _natural_key(path: Path) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def _monitor(rows: Sequence[Any]) -> str | None:
    monitors = {r.monitor for r in rows if r.monitor}
    return monitors.pop() if len(monitors) == 1 else None


def _metric_columns(rows: Sequence[Any], skip: str | None) -> list[str]:
    """Every final and test metric name of the rows (the task's names), except ``skip``
    (the monitored metric, which has its own final/best/test columns) and its test twin."""
    names = {k for r in rows for k in r.metrics}
    if skip:
        names -= {skip, test_name(skip)}
    return sorted(names)


def _columns(rows: Sequence[Row]) -> list[str]:
    """COLUMNS, with the task's other metrics after the monitored one's test value; ``apart``
    only where some run was set apart."""
    at = COLUMNS.index("test") + 1
    columns = [*COLUMNS[:at], *_metric_columns(rows, _monitor(rows)), *COLUMNS[at:]]
    return [c for c in columns if c != "apart" or any(r.apart for r in rows)]


def _titles(rows: Sequence[Any], columns: Sequence[str]) -> list[str]:
    metric = _monitor(rows)
    names = {"final": f"final {metric or 'metric'}", "best": f"best {metric or 'metric'}",
             "test": test_name(metric) if metric else "test", "wall_time_s": "wall s",
             "apart": "set apart by"}
    return [names.get(c, c) for c in columns]


def _varying_overrides(rows: Sequence[Any]) -> set | None:
    """Overrides not shared by every row: what a sweep varies (None: show them all)."""
    if len(rows) < 2:
        return None
    common = set(rows[0].overrides).intersection(*(r.overrides for r in rows[1:]))
    return {o for r in rows for o in r.overrides} - common


def _cell(row: Row, column: str, varying: set | None = None) -> str:
    if "/" in column:  # a final metric of the task
        value = row.metrics.get(column)
        return "" if value is None else f"{value:.4f}"
    value = getattr(row, column)
    if value is None:
        return ""
    if column == "overrides":
        # The table shows what differs between runs; csv/json keep every override.
        return " ".join(o for o in value if varying is None or o in varying)
    if column == "apart":
        return ", ".join(value)
    if column == "error":
        # One line in a table; the full text is in the csv/json and the job's log.
        text = " ".join(str(value).split())
        return text if len(text) <= 120 else text[:117] + "..."
    if column in ("final", "best", "test"):
        return f"{value:.4f}"
    if column == "wall_time_s":
        return f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
