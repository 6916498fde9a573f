"""PNG plots of loss, accuracy and density against step, from metrics.csv files."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from typing import Any


def moving_average(values: Sequence[float], width: int) -> list[float]:
    """Trailing mean over ``width`` values (fewer at the start), NaN-aware.

    A NaN value (a non-finite logged step, an empty cell of metrics.csv) is left out of
    the windows it falls in: it does not poison every later mean (as a running sum
    would); a window holding no number gives NaN."""
    if width < 1:
        raise ValueError(f"moving average width must be >= 1, got {width}")
    out: list[float] = []
    total, count = 0.0, 0
    for i, value in enumerate(values):
        if not math.isnan(value):
            total += value
            count += 1
        if i >= width:
            old = values[i - width]
            if not math.isnan(old):
                total -= old
                count -= 1
        if count == 0:
            total = 0.0  # the window is empty: drop the rounding left by the sum
        out.append(total / count if count else math.nan)
    return out


def read_metrics_csv(path: str) -> dict[str, list[float]]:
    """metrics.csv -> {column: values}; empty cells become nan. A header-only file gives
    its columns with no values."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        names = [name for name in reader.fieldnames or () if name]
    columns: dict[str, list[float]] = {name: [] for name in names}
    for row in rows:
        for key in names:
            value = row.get(key)
            columns[key].append(float(value) if value not in ("", None) else math.nan)
    return columns


class MetricsFileError(ValueError):
    """A metrics.csv a script cannot use; the message names the file."""


def load_metrics_csv(path: str, required: Sequence[str] = ("step",)) -> dict[str, list[float]]:
    """:func:`read_metrics_csv` for the scripts: a :class:`MetricsFileError` naming
    ``path`` when it cannot be read (missing, a directory), is not a CSV of numbers,
    lacks a ``required`` column or has no rows."""
    try:
        data = read_metrics_csv(path)
    except OSError as err:
        raise MetricsFileError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (ValueError, UnicodeDecodeError, csv.Error) as err:
        raise MetricsFileError(f"{path}: not a metrics.csv of numbers ({err})") from None
    if not data:
        raise MetricsFileError(f"{path}: empty (no header, no rows)")
    missing = [name for name in required if name not in data]
    if missing:
        have = ", ".join(data)
        raise MetricsFileError(f"{path}: no {', '.join(missing)} column (columns: {have})")
    if not any(data.values()):
        raise MetricsFileError(f"{path}: no rows yet (only the header)")
    return data


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


def plot_run(config: Any, output_dir: str, primary: bool = True) -> str | None:
    """``<output_dir>/metrics.png`` of a run's ``metrics.csv``, titled with the config's
    name and mechanism; None when the run has written no CSV (or off process 0)."""
    csv_path = os.path.join(output_dir, "metrics.csv")
    if not primary or not os.path.isfile(csv_path):
        return None
    name = str(config.get("name", "run"))
    return plot_metrics(
        [csv_path],
        os.path.join(output_dir, "metrics.png"),
        labels=[name],
        title=f"{name} ({config.model.attention})",
    )
