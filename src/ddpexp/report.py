"""Tables of runs: one row per run dir, read from what the run left on disk.

The sweep launcher writes ``summary.csv`` / ``summary.md`` with this module and prints the
same table; ``python -m ddpexp.report DIR`` (``ddpexp-report DIR``) prints it for any sweep
dir, single run dir or ``outputs/`` tree. The API is small so that other tools (plots,
TensorBoard HParams) can build on the same rows::

    rows = collect(sweep_dir)            # list[Row], best first
    print(format_rows(rows, "text"))     # or "md", "csv", "json"
    write_summary(sweep_dir, rows)       # summary.csv + summary.md

Everything is read from each run dir's ``metrics.json`` (written by ddpexp's trainer:
status, epochs, steps, ``final``/``best`` metrics, ``monitor``/``monitor_mode``, wall time,
``error``) and ``.hydra/overrides.yaml``. A run dir without ``metrics.json`` still gets a row
(status ``no metrics``), so a job that failed before training is never silently missing.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

METRICS_FILE = "metrics.json"
FORMATS = ("text", "md", "csv", "json")
NO_METRICS = "no metrics"
# Columns of every format, in order (csv/json use the field names, text/md the titles).
COLUMNS = ("job", "overrides", "status", "final", "best", "epochs", "steps", "wall_time_s", "error")


@dataclass
class Row:
    """One run (a sweep job or a single run) as the summary shows it."""

    job: str
    overrides: list[str] = field(default_factory=list)
    status: str = NO_METRICS
    monitor: Optional[str] = None
    monitor_mode: str = "max"
    final: Optional[float] = None
    best: Optional[float] = None
    epochs: Optional[int] = None
    steps: Optional[int] = None
    wall_time_s: Optional[float] = None
    error: Optional[str] = None
    dir: Optional[str] = None
    # The final validation metrics, whatever the task names them ({"val/mse": .., ...}).
    metrics: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain values, overrides joined by spaces, one key per final metric (what csv and
        json hold)."""
        out = asdict(self)
        out["overrides"] = " ".join(self.overrides)
        out.update(out.pop("metrics"))
        return out


def read_run(run_dir: Path, job: Optional[str] = None) -> Row:
    """The row of one run dir (``job`` names it in the table; default: the dir's name)."""
    run_dir = Path(run_dir)
    row = Row(job=job if job is not None else run_dir.name, dir=str(run_dir),
              overrides=_read_overrides(run_dir))
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return row
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        row.status, row.error = "unreadable", f"{path}: {exc}"
        return row
    monitor = data.get("monitor")
    row.status = str(data.get("status", "unknown"))
    row.monitor = monitor
    row.monitor_mode = str(data.get("monitor_mode", "max"))
    row.final = _number((data.get("final") or {}).get(monitor)) if monitor else None
    row.best = _number((data.get("best") or {}).get(monitor)) if monitor else None
    row.epochs = data.get("epochs")
    row.steps = data.get("steps")
    row.wall_time_s = _number(data.get("wall_time_s"))
    row.error = data.get("error")
    final = data.get("final") or {}
    row.metrics = {k: v for k, v in final.items() if _number(v) is not None} if isinstance(final, dict) else {}
    return row


def run_dirs(root: Path) -> list[Path]:
    """Run dirs under ``root`` (``root`` itself if it is one): dirs that hold
    ``.hydra/config.yaml`` or ``metrics.json``."""
    root = Path(root)
    if _is_run_dir(root):
        return [root]
    found = {p.parent for p in root.rglob(METRICS_FILE)}
    found |= {p.parent.parent for p in root.rglob("config.yaml") if p.parent.name == ".hydra"}
    return sorted((d for d in found if ".hydra" not in d.relative_to(root).parts),
                  key=lambda d: _natural_key(d.relative_to(root)))


def collect(root: Path) -> list[Row]:
    """Rows of every run under ``root`` (a sweep dir, a run dir or ``outputs/``), best first.
    A row's ``job`` is its dir relative to ``root`` (the job number in a sweep dir)."""
    root = Path(root)
    rows = [read_run(d, job=str(d.relative_to(root)) if d != root else d.name)
            for d in run_dirs(root)]
    return sort_rows(rows)


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
    titles = _titles(rows, columns)
    varying = _varying_overrides(rows)
    cells = [[_cell(r, c, varying) for c in columns] for r in rows]
    if fmt == "md":
        lines = ["| " + " | ".join(titles) + " |", "|" + "|".join("---" for _ in titles) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines) + "\n"
    widths = [max(len(t), *(len(row[i]) for row in cells)) if cells else len(t)
              for i, t in enumerate(titles)]
    lines = ["  ".join(t.ljust(w) for t, w in zip(titles, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines) + "\n"


def write_summary(directory: Path, rows: Sequence[Row]) -> tuple[Path, Path]:
    """Write ``summary.csv`` and ``summary.md`` into ``directory``; returns their paths."""
    directory = Path(directory)
    csv_path, md_path = directory / "summary.csv", directory / "summary.md"
    csv_path.write_text(format_rows(rows, "csv"))
    md_path.write_text(format_rows(rows, "md"))
    return csv_path, md_path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ddpexp.report DIR [--format F]``: print the table of the runs under DIR."""
    parser = argparse.ArgumentParser(prog="ddpexp-report", description=main.__doc__)
    parser.add_argument("dir", type=Path, help="a sweep dir, a run dir or outputs/")
    parser.add_argument("--format", "-f", choices=FORMATS, default="text")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="also draw the runs' validation curves (the monitored metric and val/loss), one line per run")
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"{args.dir} is not a directory")
    rows = collect(args.dir)
    if not rows:
        print(f"no runs under {args.dir}", file=sys.stderr)
        return 1
    sys.stdout.write(format_rows(rows, args.format))
    if args.plot is not None:
        from ddpexp.plot import plot_curves

        varying = _varying_overrides(rows)
        runs = [(_label(r, varying), Path(r.dir)) for r in rows if r.dir]
        monitor = _monitor(rows) or "val/loss"
        tags = [monitor] + (["val/loss"] if monitor != "val/loss" else [])
        drawn = plot_curves(runs, args.plot, tags)
        print(f"wrote {args.plot}: {drawn} runs, one curve each", file=sys.stderr)
    return 0


def _label(row: Row, varying: Optional[set]) -> str:
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
    return [str(o) for o in data or []]


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _natural_key(path: Path) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def _monitor(rows: Sequence[Row]) -> Optional[str]:
    monitors = {r.monitor for r in rows if r.monitor}
    return monitors.pop() if len(monitors) == 1 else None


def _metric_columns(rows: Sequence[Row], skip: Optional[str]) -> list[str]:
    """Every final metric name of the rows (the task's names), except ``skip``."""
    names = {k for r in rows for k in r.metrics if k != skip}
    return sorted(names)


def _columns(rows: Sequence[Row]) -> list[str]:
    """COLUMNS, with the task's other final metrics after the monitored one's best."""
    at = COLUMNS.index("best") + 1
    return [*COLUMNS[:at], *_metric_columns(rows, _monitor(rows)), *COLUMNS[at:]]


def _titles(rows: Sequence[Row], columns: Sequence[str]) -> list[str]:
    metric = _monitor(rows) or "metric"
    names = {"final": f"final {metric}", "best": f"best {metric}", "wall_time_s": "wall s"}
    return [names.get(c, c) for c in columns]


def _varying_overrides(rows: Sequence[Row]) -> Optional[set]:
    """Overrides not shared by every row: what a sweep varies (None: show them all)."""
    if len(rows) < 2:
        return None
    common = set(rows[0].overrides).intersection(*(r.overrides for r in rows[1:]))
    return {o for r in rows for o in r.overrides} - common


def _cell(row: Row, column: str, varying: Optional[set] = None) -> str:
    if "/" in column:  # a final metric of the task
        value = row.metrics.get(column)
        return "" if value is None else f"{value:.4f}"
    value = getattr(row, column)
    if value is None:
        return ""
    if column == "overrides":
        # The table shows what differs between runs; csv/json keep every override.
        return " ".join(o for o in value if varying is None or o in varying)
    if column == "error":
        # One line in a table; the full text is in the csv/json and the job's log.
        text = " ".join(str(value).split())
        return text if len(text) <= 120 else text[:117] + "..."
    if column in ("final", "best"):
        return f"{value:.4f}"
    if column == "wall_time_s":
        return f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
