"""One markdown row per synthetic-task run: what docs/results.md and docs/synthetic.md show.

  python scripts/synthetic_table.py runs/synthetic_sbm_quick-* runs/synthetic_full_quick-*

For each run directory (``config.json``, ``metrics.csv`` and, once finished,
``summary.json``): the mechanism, the mask estimator, the seed, the eval accuracy and
density of the final evaluation, the highest training density (moving average), the
step the run leaves the all-ones baseline (moving-average training accuracy first at
``--leave`` or above) and the step it first reaches ``--solved``. A run that stopped
before its last step is marked with the step it reached; its "final" columns are then
the last logged training figures, not an evaluation.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import math  # noqa: E402

from absl import flags  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.script_usage import UsageError  # noqa: E402
from sbm_jax.training.plots import (  # noqa: E402
    MetricsFileError,
    load_metrics_csv,
    moving_average,
)

_LEAVE = flags.DEFINE_float("leave", 0.70, "Accuracy that counts as leaving the baseline.")
_SOLVED = flags.DEFINE_float("solved", 0.99, "Accuracy that counts as solved.")
_SMOOTH = flags.DEFINE_integer(
    "smooth", 20, "Moving average over this many logged steps.", lower_bound=1
)


def first_step_at(steps: list[float], values: list[float], level: float) -> int | None:
    """First step whose value is at least ``level`` (None if never)."""
    for step, value in zip(steps, values, strict=True):
        if value >= level:
            return int(step)
    return None


def read_json(path: str) -> dict[str, object]:
    """A run's JSON record; a :class:`UsageError` naming ``path`` when it is missing,
    unreadable or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist (not a run directory?)") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path}: not a JSON object")
    return value


def load_run(run: str) -> tuple[dict[str, object], dict[str, list[float]]]:
    """``(config, metrics)`` of a run directory; a :class:`UsageError` naming the file
    when either is missing or unusable (checked for every run before any row)."""
    if not os.path.isdir(run):
        raise UsageError(f"{run}: not a run directory")
    config = read_json(os.path.join(run, "config.json"))
    try:
        metrics = load_metrics_csv(os.path.join(run, "metrics.csv"), ("step", "accuracy"))
    except MetricsFileError as err:
        raise UsageError(str(err)) from None
    return config, metrics


def _max(values: list[float]) -> float | None:
    """The largest number of ``values`` (NaN left out); None when there is none."""
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else None


def run_row(run: str, leave: float, solved: float, smooth: int) -> dict[str, object]:
    """The table's figures for one run directory."""
    config, metrics = load_run(run)
    model = config.get("model", {})
    options = model.get("attention_options", {}) or {}
    steps, acc = metrics["step"], moving_average(metrics["accuracy"], smooth)
    # no density logged (full attention writes empty cells; old files lack the column):
    # unknown, shown as "-", not as a density of 1 or as "never"
    dens = moving_average(metrics.get("density", [math.nan] * len(steps)), smooth)
    row: dict[str, object] = {
        "run": os.path.basename(os.path.normpath(run)),
        "attention": model.get("attention", "?"),
        "ste": options.get("ste", "paper") if model.get("attention") == "sbm" else "-",
        "qk_init": model.get("query_key_init", "independent"),
        "seed": config.get("seed", "?"),
        "leaves_baseline": first_step_at(steps, acc, leave),
        "solved": first_step_at(steps, acc, solved),
        "max_density": _max(dens),
        "last_step": int(steps[-1]) if steps else 0,
    }
    summary_path = os.path.join(run, "summary.json")
    if os.path.exists(summary_path):
        summary = read_json(summary_path)
        final = summary.get("eval") or {}
        row["accuracy"] = final.get("accuracy", summary.get("accuracy"))
        row["density"] = final.get("density", summary.get("density"))
        row["finished"] = True
    else:
        row["accuracy"], row["density"] = acc[-1] if acc else None, dens[-1] if dens else None
        row["finished"] = False
    return row


def _fmt(value: object, digits: int = 3, missing: str = "never") -> str:
    """``value`` for the table; ``missing`` where it is None or NaN (a step never
    reached, a density never logged)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(rows: list[dict[str, object]]) -> str:
    """The rows as a markdown table."""
    head = (
        "| run | attention | estimator | QK init | seed | final accuracy | final density "
        "| highest density | leaves baseline | solved |\n" + "|---" * 10 + "|\n"
    )
    lines = []
    for r in rows:
        final = "" if r["finished"] else f" (stopped at {r['last_step']}, train MA)"
        lines.append(
            f"| {r['run']} | {r['attention']} | {r['ste']} | {r['qk_init']} | {r['seed']} "
            f"| {_fmt(r['accuracy'], 4)}{final} | {_fmt(r['density'], 2, '-')} "
            f"| {_fmt(r['max_density'], 2, '-')} | {_fmt(r['leaves_baseline'])} "
            f"| {_fmt(r['solved'])} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    runs = argv[1:]
    if not runs:
        raise UsageError("give one or more synthetic-task run directories")
    for run in runs:  # every run's files checked before any row is printed
        load_run(run)
    rows = [run_row(run, _LEAVE.value, _SOLVED.value, _SMOOTH.value) for run in runs]
    print(markdown(rows), end="")


if __name__ == "__main__":
    script_usage.run(main)
