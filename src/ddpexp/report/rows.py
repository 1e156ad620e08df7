"""The rows of ``ddpexp.report``: one per run dir, read from what the run left on disk, and
the table of them in each format (:func:`collect`, :func:`format_rows`)."""

from __future__ import annotations

import copy
import csv
import io
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ddpexp import provenance
from ddpexp.record import METRICS_FILE, UnreadableRecord, read_metrics

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
    row.final = number(_entry(data, "final", monitor))
    row.best = number(_entry(data, "best", monitor))
    row.epochs = data.get("epochs")
    row.steps = data.get("steps")
    row.wall_time_s = number(data.get("wall_time_s"))
    row.train_time_s = number(data.get("train_time_s"))
    row.error = data.get("error")
    for part in ("final", "test"):
        values = data.get(part) or {}
        if isinstance(values, dict):
            row.metrics.update({k: v for k, v in values.items()
                                if "/" in k and number(v) is not None})
    row.test = number(row.metrics.get(test_name(monitor))) if monitor else None
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
                  key=lambda d: natural_key(d.relative_to(root)))


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
            return (1, 0.0, natural_key(Path(row.job)))
        value = -row.best if row.monitor_mode == "max" else row.best
        return (0, value, natural_key(Path(row.job)))

    return sorted(rows, key=key)


def format_rows(rows: Sequence[Row], fmt: str = "text") -> str:
    """The table in ``fmt``: ``text`` (aligned columns), ``md``, ``csv`` or ``json``."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "json":
        return json.dumps([r.as_dict() for r in rows], indent=2) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        names = [f.name for f in fields(Row) if f.name != "metrics"] + metric_columns(rows, None)
        writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
        return buf.getvalue()
    columns = _columns(rows)
    varying = varying_overrides(rows)
    cells = [[_cell(r, c, varying) for c in columns] for r in rows]
    return render(column_titles(rows, columns), cells, fmt)


def render(titles: Sequence[str], cells: Sequence[Sequence[str]], fmt: str) -> str:
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


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def natural_key(path: Path) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def monitor_of(rows: Sequence[Any]) -> str | None:
    monitors = {r.monitor for r in rows if r.monitor}
    return monitors.pop() if len(monitors) == 1 else None


def metric_columns(rows: Sequence[Any], skip: str | None) -> list[str]:
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
    columns = [*COLUMNS[:at], *metric_columns(rows, monitor_of(rows)), *COLUMNS[at:]]
    return [c for c in columns if c != "apart" or any(r.apart for r in rows)]


def column_titles(rows: Sequence[Any], columns: Sequence[str]) -> list[str]:
    metric = monitor_of(rows)
    names = {"final": f"final {metric or 'metric'}", "best": f"best {metric or 'metric'}",
             "test": test_name(metric) if metric else "test", "wall_time_s": "wall s",
             "apart": "set apart by"}
    return [names.get(c, c) for c in columns]


def varying_overrides(rows: Sequence[Any]) -> set | None:
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


def own_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` without ``resume=``: it says how a run was continued (a resumed sweep's
    jobs all get ``resume=auto``), not what the run is."""
    return [str(o) for o in overrides if override_key(str(o)) != "resume"]


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
