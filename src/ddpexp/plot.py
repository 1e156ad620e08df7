"""Validation curves of several runs in one PNG, read from their TensorBoard event files:
one line per run, or one mean line with a band per group of runs (the seeds of a
configuration)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def read_curve(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` points of one scalar tag of a run (empty if the run never logged it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = Path(run_dir) / "tb"
    if not tb.is_dir():
        return []
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def plot_curves(runs: Sequence[tuple[str, Path]], out: Path, tags: Sequence[str] = ("val/acc", "val/loss")) -> int:
    """Draw one line per run (``(label, run_dir)``) for each tag, side by side, into ``out``.
    Returns the number of runs that had a curve to draw."""
    fig, axes = _figure(tags)
    drawn = set()
    for ax, tag in zip(axes[0], tags, strict=True):
        for label, run_dir in runs:
            points = read_curve(run_dir, tag)
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                drawn.add(str(run_dir))
    _save(fig, axes, out)
    return len(drawn)


def mean_curve(run_dirs: Sequence[Path], tag: str) -> list[tuple[int, float, float, int]]:
    """``(step, mean, std, runs)`` at every step that each run which logged ``tag`` logged
    (the sample standard deviation; 0 for one run)."""
    import statistics

    curves = [dict(c) for c in (read_curve(d, tag) for d in run_dirs) if c]
    if not curves:
        return []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    out = []
    for step in steps:
        values = [c[step] for c in curves]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        out.append((step, statistics.fmean(values), std, len(values)))
    return out


def plot_groups(groups: Sequence[tuple[str, Sequence[Path]]], out: Path,
                tags: Sequence[str] = ("val/acc", "val/loss")) -> int:
    """Draw, for each group (``(label, run_dirs)``: the seeds of one configuration), the mean
    curve of each tag and a band of one standard deviation around it. Returns the number of
    groups that had a curve to draw."""
    fig, axes = _figure(tags)
    drawn = set()
    for ax, tag in zip(axes[0], tags, strict=True):
        for label, dirs in groups:
            points = mean_curve(dirs, tag)
            if not points:
                continue
            steps, means, stds, counts = zip(*points, strict=True)
            line, = ax.plot(steps, means, marker="o", markersize=3, label=f"{label} (n={max(counts)})")
            ax.fill_between(steps, [m - s for m, s in zip(means, stds, strict=True)],
                            [m + s for m, s in zip(means, stds, strict=True)], color=line.get_color(), alpha=0.2)
            drawn.add(label)
    _save(fig, axes, out)
    return len(drawn)


def _figure(tags: Sequence[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tags), figsize=(6 * len(tags), 4.2), squeeze=False)
    for ax, tag in zip(axes[0], tags, strict=True):
        ax.set_title(tag)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    return fig, axes


def _save(fig, axes, out: Path) -> None:
    import matplotlib.pyplot as plt

    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8,
                   frameon=False)
        fig.subplots_adjust(bottom=0.12 + 0.05 * ((len(labels) - 1) // 4 + 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
