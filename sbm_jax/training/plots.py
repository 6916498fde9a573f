"""PNG plots of loss, accuracy and density against step, from metrics.csv files."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence


def moving_average(values: Sequence[float], width: int) -> list[float]:
    """Trailing mean over ``width`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def read_metrics_csv(path: str) -> dict[str, list[float]]:
    """metrics.csv -> {column: values}; empty cells become nan."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            columns.setdefault(key, []).append(
                float(value) if value not in ("", None) else math.nan
            )
    return columns


def plot_metrics(
    csv_paths: Sequence[str],
    out_path: str,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> str:
    """Plot loss, accuracy and density vs step for one or more runs into ``out_path``.

    Args:
      csv_paths: metrics.csv files (columns step, loss, accuracy, density).
      out_path: PNG file to write.
      labels: legend label per run (default: the paths).
      title: figure title.

    Returns:
      ``out_path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels is not None else list(csv_paths)
    if len(labels) != len(csv_paths):
        raise ValueError(f"{len(labels)} labels for {len(csv_paths)} csv files")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for path, label in zip(csv_paths, labels, strict=True):
        data = read_metrics_csv(path)
        steps = data.get("step", [])
        for ax, key in zip(axes, ("loss", "accuracy", "density"), strict=True):
            values = data.get(key, [])
            if values and not all(math.isnan(v) for v in values):
                ax.plot(steps, values, label=label, linewidth=1.2)
    for ax, key in zip(axes, ("loss", "accuracy", "density"), strict=True):
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[2].set_ylim(-0.02, 1.02)
    if len(csv_paths) > 1:
        axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
