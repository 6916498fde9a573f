"""Render the paper's Table 4 (rows: mechanisms, columns: SST-2 / QQP / MNLI / QNLI F1)
from GLUE fine-tuning summaries, and our accuracy beside it.

  python scripts/glue_report.py runs/glue_*/summary.json [--paper] [--output=table.md]

Each summary contributes its ``headline`` (F1 of the positive class for SST-2, QQP and
QNLI; macro-F1 averaged over matched and mismatched validation for MNLI) to the cell of
its ``mechanism`` and task, as a percentage. Several runs of one cell are averaged and
shown as mean ± standard deviation (n runs). ``--paper`` appends the published F1 rows.
A second table holds the same runs' accuracy (``headline_accuracy``: validation
accuracy, MNLI averaged over its two splits); the paper reports F1 only, so accuracy has
no paper row to compare with.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from configs.glue.common import MECHANISMS
from sbm_jax import script_usage

TASKS = ("sst2", "qqp", "mnli", "qnli")
TASK_HEADERS = {"sst2": "SST-2", "qqp": "QQP", "mnli": "MNLI", "qnli": "QNLI"}
ROW_ORDER = MECHANISMS  # the GLUE configs' mechanisms, in Table 4 order
ROW_LABELS = {
    "full": "Full-attention",
    "reformer": "Reformer",
    "performer": "Performer",
    "linformer": "Linformer",
    "nystromformer": "Nyströmformer",
    "sbm": "SBM-Transformer (+ window 64)",
    "sbm_nowindow": "SBM-Transformer (no window)",
    "local": "Local window 64",
}
# Table 4 of the paper (F1, %).
PAPER = {
    "full": (89.8, 84.7, 84.0, 85.0),
    "reformer": (89.3, 84.4, 83.9, 84.0),
    "performer": (82.0, 65.6, 71.4, 59.3),
    "linformer": (82.0, 83.2, 79.3, 82.5),
    "nystromformer": (89.7, 83.2, 84.1, 84.9),
    "sbm": (89.8, 85.2, 83.5, 83.6),
}


def summary_paths(args: Iterable[str]) -> list[tuple[str, bool]]:
    """Expand globs and directories (``<dir>/summary.json``) into summary files:
    ``(path, found by a glob rather than named)``. A file named twice (a run dir and its
    summary.json, overlapping globs) counts once, as named if it ever was."""
    paths: dict[str, tuple[str, bool]] = {}
    for arg in args:
        for match in sorted(glob.glob(arg)) or [arg]:
            if os.path.isdir(match):
                match = os.path.join(match, "summary.json")
            if not os.path.isfile(match):
                what = "matched no file" if glob.has_magic(arg) else "does not exist"
                raise FileNotFoundError(f"summary {match!r} {what}")
            key = os.path.realpath(match)
            first, globbed = paths.get(key, (match, True))
            paths[key] = (first, globbed and glob.has_magic(arg))
    return list(paths.values())


def load_summaries(paths: Sequence[str], globbed: Sequence[bool] = ()) -> list[dict]:
    """The summaries at ``paths``; a file that is not a GLUE fine-tuning run's summary
    (a pretraining run's, say) is a ValueError naming it, except that a pretraining
    run's summary a glob found (``paths[i]`` with ``globbed[i]``) is left out with a note
    on stderr: ``runs/glue_*`` also matches the pretraining runs' default folders
    (``runs/glue_pretrain_<mechanism>-<time>``)."""
    summaries = []
    for i, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            try:
                summary = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not JSON ({e})") from None
        if i < len(globbed) and globbed[i] and summary.get("task") == PRETRAINING_TASK:
            print(f"note: {path} is a pretraining run's summary: left out", file=sys.stderr)
            continue
        if "init_from" in summary and not summary["init_from"]:
            # Fine-tuned from random weights (no config.init_from): not a Table 4 number.
            print(
                f"note: {path} was not fine-tuned from a pretrained encoder: left out",
                file=sys.stderr,
            )
            continue
        try:
            for key in ("headline", "headline_accuracy"):
                collect([summary], key)
        except ValueError as e:
            raise ValueError(f"{path}: {e} (not a GLUE fine-tuning run's summary.json?)") from None
        for key in ("headline", "headline_accuracy"):
            if not math.isfinite(float(summary[key])):
                print(
                    f"note: {path}: {key} is {summary[key]} (did the run diverge?)", file=sys.stderr
                )
        summaries.append(summary)
    return summaries


#: The task name in a pretraining run's summary (configs/glue/pretrain.py).
PRETRAINING_TASK = "glue_mlm"


def _task_of(summary: dict) -> str:
    """``glue_task`` ("sst2"), else ``task`` with any ``glue_`` prefix removed."""
    task = str(summary.get("glue_task") or summary.get("task", ""))
    return task[len("glue_") :] if task.startswith("glue_") else task


def collect(summaries: Sequence[dict], key: str = "headline") -> dict[str, dict[str, list[float]]]:
    """{mechanism: {task: [summary[key] %, ...]}}; a summary lacking a field is an error."""
    cells: dict[str, dict[str, list[float]]] = {}
    for s in summaries:
        for field in ("mechanism", "task", key):
            if s.get(field) is None:
                raise ValueError(f"summary of {s.get('name', '?')!r} lacks {field!r}")
        task = _task_of(s)
        if task not in TASKS:
            raise ValueError(f"summary task {s['task']!r} is not one of {TASKS}")
        cells.setdefault(str(s["mechanism"]), {}).setdefault(task, []).append(100.0 * float(s[key]))
    return cells


def _cell(values: list[float] | None) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f} ({len(values)})"


def render_table(cells: dict[str, dict[str, list[float]]], with_paper: bool = False) -> str:
    """Markdown table in Table 4's layout."""
    header = "| Model | " + " | ".join(TASK_HEADERS[t] for t in TASKS) + " |"
    lines = [header, "|" + "---|" * (len(TASKS) + 1)]
    rows = [m for m in ROW_ORDER if m in cells] + sorted(m for m in cells if m not in ROW_ORDER)
    for mechanism in rows:
        label = ROW_LABELS.get(mechanism, mechanism)
        values = [_cell(cells[mechanism].get(t)) for t in TASKS]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    if with_paper:
        for mechanism, values in PAPER.items():
            label = f"{ROW_LABELS[mechanism]} (paper)"
            lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="+", help="summary.json files, run dirs or globs")
    parser.add_argument("--paper", action="store_true", help="append the paper's Table 4 rows")
    parser.add_argument("--output", default="", help="also write the table to this file")
    args = parser.parse_args(argv)
    try:
        if args.output:
            script_usage.output_file("output", args.output)
    except script_usage.UsageError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        found = summary_paths(args.summaries)
        summaries = load_summaries([p for p, _ in found], [g for _, g in found])
        if not summaries:
            raise ValueError(f"{' '.join(args.summaries)}: no fine-tuning run's summary")
    except (OSError, ValueError) as e:
        # A glob that matched nothing, a file that is not a fine-tuning summary: one line.
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    table = render_table(collect(summaries), with_paper=args.paper)
    table += "\nAccuracy (%), same runs (the paper reports F1 only):\n\n"
    table += render_table(collect(summaries, "headline_accuracy"))
    sys.stdout.write(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
