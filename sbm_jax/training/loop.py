"""The training loop every task shares, and ``run_training``, which wraps it with
config checks, output files, a final evaluation and a plot."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import time
from types import SimpleNamespace
from typing import Any, TextIO

import flax.linen as nn
import jax
from jax.sharding import Mesh

from sbm_jax.models import build_model
from sbm_jax.training.config_checks import prepare_output_dir, validate_config
from sbm_jax.training.metrics import MetricsWriter, ProgressBar, to_python
from sbm_jax.training.plots import plot_metrics
from sbm_jax.training.state import TrainState, create_train_state, learning_rate_schedule
from sbm_jax.training.steps import (
    evaluate,
    make_eval_step,
    make_mesh,
    make_train_step,
    replicated,
    shard_batch,
)
from sbm_jax.training.task import Task


@dataclasses.dataclass
class TrainResult:
    """What ``train`` returns.

    Attributes:
      state: the train state after the last step (feed it back to ``train`` to continue).
      history: host metric records of the steps run, one per step.
      eval_metrics: metrics of the last evaluation, if the task has eval batches.
      wall_time_s: seconds spent in the loop (compilation included).
      steps_per_s: steady-state rate, measured from the first step's completion.
    """

    state: TrainState
    history: list[dict[str, Any]]
    eval_metrics: dict[str, float] | None
    wall_time_s: float
    steps_per_s: float


@functools.lru_cache(maxsize=8)
def _compiled_steps(
    task: Task, mesh: Mesh, density_lambda: float, schedule_args: tuple[float, int, int, float]
) -> tuple[Any, Any]:
    """Jitted steps, reused across ``train`` calls (a resumed run does not recompile)."""
    lr, warmup, steps, end = schedule_args
    schedule = learning_rate_schedule(
        SimpleNamespace(
            learning_rate=lr, warmup_steps=warmup, num_steps=steps, end_learning_rate_factor=end
        )
    )
    train_step = make_train_step(task, mesh, density_lambda, schedule)
    eval_step = make_eval_step(task, mesh) if task.eval_batches is not None else None
    return train_step, eval_step


def _record(step: int, metrics: dict[str, Any], start_time: float) -> dict[str, Any]:
    record = {"step": step, "split": "train", "time_s": time.perf_counter() - start_time}
    record.update({k: v for k, v in to_python(metrics).items() if k != "weight"})
    return record


def train(
    config: Any,
    task: Task,
    *,
    model: nn.Module | None = None,
    state: TrainState | None = None,
    mesh: Mesh | None = None,
    until_step: int | None = None,
    writer: MetricsWriter | None = None,
    progress: ProgressBar | None = None,
    run_final_eval: bool = True,
) -> TrainResult:
    """Run training steps from ``state`` (or a fresh state) up to ``until_step``.

    Args:
      config: full config (``seed``, ``model``, ``train``).
      task: the task's batches, loss and head.
      model: the model (default ``build_model(config.model, task.head)``); it must be
        the model ``state`` was made with.
      state: state to continue from; None starts from ``config.seed``.
      mesh: 1-axis ``data`` mesh (default: all devices).
      until_step: stop when ``state.step`` reaches this (default
        ``config.train.num_steps``). Running to N and then continuing to 2N gives the
        same result as running to 2N at once.
      writer: receives one record per step (and eval records), if given.
      progress: progress bar, if given.
      run_final_eval: evaluate at the end when the task has eval batches.

    Returns:
      ``TrainResult``.
    """
    train_cfg = config.train
    mesh = make_mesh() if mesh is None else mesh
    model = build_model(config.model, task.head) if model is None else model
    until = int(train_cfg.num_steps) if until_step is None else int(until_step)
    start = 0 if state is None else int(jax.device_get(state.step))
    batches = task.train_batches(start)
    if state is None:
        first = next(batches)
        state = create_train_state(config, model, task, first)
        batches = itertools.chain([first], batches)
    state = jax.device_put(state, replicated(mesh))

    train_step, eval_step = _compiled_steps(
        task,
        mesh,
        float(train_cfg.density_lambda),
        (
            float(train_cfg.learning_rate),
            int(train_cfg.warmup_steps),
            int(train_cfg.num_steps),
            float(train_cfg.end_learning_rate_factor),
        ),
    )
    eval_rng = jax.random.PRNGKey(int(config.seed) + 1)
    log_every = int(train_cfg.log_every)
    eval_every = int(train_cfg.get("eval_every", 0))

    history: list[dict[str, Any]] = []
    eval_metrics: dict[str, float] | None = None
    pending: list[tuple[int, Any]] = []
    t0 = time.perf_counter()
    first_done: tuple[int, float] | None = None

    def flush() -> None:
        nonlocal first_done
        if not pending:
            return
        for step, record in zip(
            [s for s, _ in pending], jax.device_get([m for _, m in pending]), strict=True
        ):
            rec = _record(step, record, t0)
            history.append(rec)
            if writer is not None:
                writer.write(rec)
        if writer is not None:
            writer.flush()
        if first_done is None:
            first_done = (pending[0][0], time.perf_counter())
        if progress is not None:
            progress.update(history[-1]["step"], history[-1], force=history[-1]["step"] == until)
        pending.clear()

    def run_eval(step: int) -> dict[str, float]:
        assert eval_step is not None and task.eval_batches is not None
        result = evaluate(eval_step, state, task.eval_batches(), mesh, eval_rng)
        if writer is not None:
            writer.write({"step": step, "split": "eval", **result})
        return result

    for step in range(start, until):
        batch = next(batches)
        state, metrics = train_step(state, shard_batch(batch, mesh))
        pending.append((step + 1, metrics))
        if first_done is None or (step + 1) % log_every == 0 or step + 1 == until:
            flush()
        if eval_step is not None and eval_every and (step + 1) % eval_every == 0:
            eval_metrics = run_eval(step + 1)
    flush()
    loop_end = time.perf_counter()
    if eval_step is not None and run_final_eval and (not eval_every or until % eval_every):
        eval_metrics = run_eval(until)
    if writer is not None:
        writer.flush()
    wall = time.perf_counter() - t0
    rate = float("nan")
    if first_done is not None and until - first_done[0] > 0:
        rate = (until - first_done[0]) / max(loop_end - first_done[1], 1e-9)
    return TrainResult(state, history, eval_metrics, wall, rate)


def default_output_dir(config: Any) -> str:
    """``config.output_dir`` if set, else ``runs/<config.name>-<timestamp>``."""
    if config.get("output_dir"):
        return str(config.output_dir)
    name = str(config.get("name", "run"))
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def run_training(
    config: Any,
    task: Task,
    output_dir: str | None = None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Validate ``config``, train, evaluate, and write the run's files.

    Writes into ``output_dir`` (default ``default_output_dir(config)``): config.json,
    metrics.jsonl, metrics.csv, metrics.png and summary.json.

    Returns:
      The summary dict (also in summary.json): final step, loss, accuracy, density,
      eval metrics, wall time, steps/s, output_dir.
    """
    validate_config(config, head=task.head)
    output_dir = prepare_output_dir(output_dir or default_output_dir(config))
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    writer = MetricsWriter(output_dir)
    progress = ProgressBar(int(config.train.num_steps), stream=progress_stream)
    try:
        result = train(config, task, writer=writer, progress=progress)
    finally:
        progress.close()
        writer.close()
    plot = plot_metrics(
        [writer.csv_path],
        os.path.join(output_dir, "metrics.png"),
        labels=[str(config.get("name", "run"))],
        title=f"{config.get('name', 'run')} ({config.model.attention})",
    )
    last = result.history[-1] if result.history else {}
    summary = {
        "name": str(config.get("name", "run")),
        "attention": str(config.model.attention),
        "step": last.get("step"),
        "loss": last.get("loss"),
        "accuracy": last.get("accuracy"),
        "density": last.get("density"),
        "eval": result.eval_metrics,
        "wall_time_s": result.wall_time_s,
        "steps_per_s": result.steps_per_s,
        "output_dir": output_dir,
        "plot": plot,
    }
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """One line: final step, train loss/accuracy/density, eval, time, output dir."""

    def num(x: Any) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    text = (
        f"final step {summary['step']} ({summary['attention']}): loss {num(summary['loss'])} "
        f"accuracy {num(summary['accuracy'])} density {num(summary['density'])}"
    )
    if summary.get("eval"):
        ev = summary["eval"]
        text += f" | eval loss {num(ev.get('loss'))} accuracy {num(ev.get('accuracy'))}"
    text += (
        f" | {summary['wall_time_s']:.1f} s ({summary['steps_per_s']:.2f} steps/s)"
        f" -> {summary['output_dir']}"
    )
    return text
