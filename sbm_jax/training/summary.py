"""The run's summary: ``summary.json`` (what was trained and what it scored) and the
one line printed at the end of a run (or when a signal stopped it)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from sbm_jax.training.run_dir import write_atomically


def to_python_json(value: Any) -> Any:
    """NaN/inf -> None so the summary is strict JSON."""
    if isinstance(value, Mapping):
        return {k: to_python_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def scalars(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record without its nested entries (per-head density, per-layer overflow,
    confusion matrices) and without ``weight``: what goes on a log line."""
    return {
        k: v
        for k, v in record.items()
        if not isinstance(v, (Mapping, list)) and k not in ("weight",)
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """One line: task, mechanism, test accuracy/density, best dev, final train loss,
    steps, time, output directory (or where and why a run stopped early)."""

    def num(x: Any) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    if "stopped_at" in summary:
        reason = f" ({summary['reason']})" if summary.get("reason") else ""
        return f"stopped at step {summary['stopped_at']}{reason} -> {summary['output_dir']}"
    rate = summary.get("steps_per_s")
    rate_text = f" ({rate:.2f} steps/s)" if isinstance(rate, float) and math.isfinite(rate) else ""
    resumed = summary.get("resumed_from")
    resumed_text = f", resumed from step {resumed}" if resumed is not None else ""
    return (
        f"{summary['task']} ({summary['attention']}, seed {summary['seed']}): "
        f"test accuracy {num(summary.get('test_accuracy'))} density "
        f"{num(summary.get('test_density'))} at step {summary.get('test_step')} | best dev "
        f"{num(summary.get('best_dev'))} | train loss {num(summary.get('loss'))} accuracy "
        f"{num(summary.get('accuracy'))} | {summary['steps']} steps{resumed_text} in "
        f"{summary['wall_time_s']:.1f} s{rate_text} -> {summary['output_dir']}"
    )


def run_summary(
    config: Any,
    *,
    loop: Mapping[str, Any],
    resumed_from: int | None,
    init_from: str | None,
    test_step: int,
    tests: Mapping[str, Mapping[str, Any]],
    predictions: Mapping[str, str],
    devices: int,
    processes: int,
    output_dir: str,
    plot: str | None,
    resolved: Mapping[str, Any],
) -> dict[str, Any]:
    """summary.json's content: what was trained (the config's name, task, mechanism,
    seed; ``loop``: the loop's ``summary_fields``), where it resumed or started from,
    and what it scored (the first test split's numbers at ``test_step`` flat, every
    split's under ``test_splits``)."""
    test = next(iter(tests.values()), {})
    return {
        "name": str(config.get("name", "run")),
        "task": str(config.task.name),
        "attention": str(config.model.attention),
        "seed": int(config.seed),
        "density_lambda": float(config.train.density_lambda),
        **loop,
        "resumed_from": resumed_from,
        "init_from": init_from,
        "test_step": test_step,
        "test_split": next(iter(tests), None),
        "test_accuracy": test.get("accuracy"),
        "test_loss": test.get("loss"),
        "test_density": test.get("density"),
        "test_density_per_head": test.get("density_per_head"),
        "test_examples": test.get("examples"),
        "test_splits": dict(tests),
        "predictions": dict(predictions),
        "devices": devices,
        "processes": processes,
        "output_dir": output_dir,
        "plot": plot,
        "config": resolved,
    }


def write_summary(output_dir: str, summary: Mapping[str, Any]) -> None:
    """``<output_dir>/summary.json`` (strict JSON, sorted keys), written atomically."""
    write_atomically(
        os.path.join(output_dir, "summary.json"),
        json.dumps(to_python_json(summary), indent=2, sort_keys=True),
    )
