"""Validation curves of several runs in one PNG, read from their TensorBoard event files."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tags), figsize=(6 * len(tags), 4.2), squeeze=False)
    drawn = set()
    for ax, tag in zip(axes[0], tags):
        for label, run_dir in runs:
            points = read_curve(run_dir, tag)
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                drawn.add(str(run_dir))
        ax.set_title(tag)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8,
                   frameon=False)
        fig.subplots_adjust(bottom=0.12 + 0.05 * ((len(labels) - 1) // 4 + 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(drawn)
