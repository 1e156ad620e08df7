"""Runs that differ only in ``seed``, grouped (:func:`group_seeds`), with the mean and
standard deviation of their metrics (:func:`format_groups`)."""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpexp.report.rows import (
    FORMATS,
    Row,
    column_titles,
    metric_columns,
    monitor_of,
    natural_key,
    number,
    override_key,
    render,
    varying_overrides,
)


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
        members = sorted(members, key=lambda r: (r.seed is None, r.seed or 0, natural_key(Path(r.job))))
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
        for name in ("final", "best", "test", *metric_columns(members, first.monitor)):
            values = [v for v in (_value(r, name) for r in members) if v is not None]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else None
                group.stats[name] = (statistics.fmean(values), std, len(values))
        out.append(group)

    def key(g: Group) -> tuple:
        best = g.stats.get("best")
        if best is None:
            return (1, 0.0, natural_key(Path(g.jobs[0])))
        return (0, -best[0] if g.monitor_mode == "max" else best[0], natural_key(Path(g.jobs[0])))

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
    stats = ["final", "best", "test", *metric_columns(groups, monitor_of(groups))]
    stats = [c for c in stats if any(c in g.stats for g in groups)]
    varying = varying_overrides(groups)
    titles = ["overrides", "n", "seeds", "status", *column_titles(groups, stats)]
    cells = [[" ".join(o for o in g.overrides if varying is None or o in varying),
              str(g.n), " ".join(map(str, g.seeds)), g.status,
              *(_mean_std(g.stats.get(c), g.n) for c in stats)] for g in groups]
    return render(titles, cells, fmt)


def _without_seed(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if override_key(o) != "seed"]


def _value(row: Row, name: str) -> float | None:
    return getattr(row, name) if name in ("final", "best", "test") else number(row.metrics.get(name))


def _mean_std(stat: tuple | None, n: int) -> str:
    if stat is None:
        return ""
    mean, std, count = stat
    text = f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"
    return text if count == n else f"{text} ({count} of {n})"
