"""The full trainer: sharded steps with gradient accumulation, dev evaluation, best-dev
and latest orbax checkpoints, resume, test evaluation at the best checkpoint, metrics
and a JSON run summary.

It is built on the shared loop's pieces (``TrainState``, ``create_train_state``,
``MetricsWriter``, ``ProgressBar``, ``validate_config``) and knows nothing task-specific:
a task is a ``TrainerTask`` (a ``Task`` with a test split too). LRA registers five; GLUE
can reuse it as is.

Config fields read beyond those of ``run_training``:
``train.max_per_device_batch`` (gradient accumulation), ``train.eval_every``,
``checkpoint.{every_steps, max_to_keep, best_metric, best_mode}``, ``mesh.data``.

Files written into the output directory: ``config.json``, ``metrics.jsonl`` (one record
per train step, plus ``split`` "dev" / "test" records), ``metrics.csv``,
``checkpoints/{latest,best}/<step>/`` and ``summary.json``. Running again with the same
output directory resumes from the latest checkpoint (or, if the run is complete, only
redoes the test evaluation and the summary). TensorBoard event files are not written:
neither tensorboardX nor CLU is a dependency of this project; ``metrics.jsonl`` holds the
same scalars (``scripts/plot_metrics.py`` plots them).

Batch layout: a global batch of ``B`` rows is split into ``A`` micro-batches of ``B / A``
rows (rows ``i*B/A .. (i+1)*B/A - 1`` form micro-batch ``i``); each micro-batch is split
over the mesh's ``data`` axis. ``A`` is the smallest count that keeps every device at or
under ``train.max_per_device_batch`` examples per pass.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sbm_jax.attention import STATS_COLLECTION
from sbm_jax.models import build_model
from sbm_jax.training.checkpoints import RunCheckpoints
from sbm_jax.training.config_checks import ConfigError, prepare_output_dir, validate_config
from sbm_jax.training.metrics import MetricsWriter, ProgressBar, to_python
from sbm_jax.training.state import TrainState, create_train_state, learning_rate_schedule
from sbm_jax.training.steps import (
    loss_and_grads,
    make_mesh,
    replicated,
    shard_batch,
    step_rngs,
)
from sbm_jax.training.task import Batch, Task

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TrainerTask(Task):
    """A ``Task`` whose ``eval_batches`` are the dev split, plus a held-out test split.

    Attributes:
      test_batches: ``() -> iterable`` of test batches (None: evaluate dev at the end).
    Batches may carry ``example_mask`` bool [batch] (False for filler rows); the
    density statistics of evaluations skip those rows.
    """

    test_batches: Callable[[], Iterable[Batch]] | None = None


def accumulation_steps(batch_size: int, num_devices: int, max_per_device: int) -> int:
    """Micro-batches per optimizer step so that each device sees at most
    ``max_per_device`` examples per pass (0: no limit).

    Returns the smallest ``A`` with ``batch_size % (A * num_devices) == 0`` and
    ``batch_size / (A * num_devices) <= max_per_device``.

    Raises:
      ConfigError naming train.batch_size (not a multiple of the devices) or
      train.max_per_device_batch (negative).
    """
    if batch_size % num_devices:
        raise ConfigError(
            f"train.batch_size={batch_size} is not a multiple of the {num_devices} devices"
        )
    if max_per_device < 0:
        raise ConfigError(f"train.max_per_device_batch={max_per_device} must be >= 0")
    if max_per_device == 0:
        return 1
    per_device = batch_size // num_devices
    for accum in range(1, per_device):
        if per_device % accum == 0 and per_device // accum <= max_per_device:
            return accum
    return per_device  # one example per device per pass always fits


def micro_batch_sharding(mesh: Mesh) -> NamedSharding:
    """[accum, micro, ...]: micro-batch rows split over ``data``."""
    return NamedSharding(mesh, P(None, "data"))


def split_micro_batches(batch: Batch, accum: int) -> dict[str, np.ndarray]:
    """Host batch [B, ...] -> [accum, B / accum, ...] (micro-batch i = rows i*B/A..)."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.shape[0] % accum:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, not divisible by {accum}")
        out[key] = value.reshape(accum, value.shape[0] // accum, *value.shape[1:])
    return out


def _weighted_mean_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics stacked over micro-batches [A, ...] -> one set: ``loss``/``accuracy``
    weighted by ``weight``, ``weight`` summed, everything else averaged."""
    weight = metrics["weight"]
    total = jnp.maximum(jnp.sum(weight), 1e-9)
    out = {}
    for key, value in metrics.items():
        if key in ("loss", "accuracy"):
            out[key] = jnp.sum(value * weight) / total
        elif key == "weight":
            out[key] = jnp.sum(weight)
        else:
            out[key] = jax.tree.map(lambda v: jnp.mean(v, axis=0), value)
    return out


def make_accumulating_train_step(
    task: Task,
    mesh: Mesh,
    density_lambda: float,
    accum_steps: int,
    schedule: optax.Schedule | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]:
    """``(state, batch [A, micro, ...]) -> (state, metrics)``, jitted; state donated.

    Each micro-batch ``i`` gives ``grad_i`` of (task loss + ``density_lambda`` x mean
    density); the update uses ``sum_i w_i grad_i / sum_i w_i`` with ``w_i`` the
    micro-batch's ``weight`` metric. For the task loss (a weighted mean over positions)
    this is exactly the gradient of the whole batch's loss; the density term gets the
    same weights, i.e. the plain mean when micro-batches weigh the same. With ``A = 1``
    this is the shared loop's ``make_train_step`` (same rng streams).
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps} must be >= 1")

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        def micro(grad_sum: Any, xs: tuple[Array, Batch]) -> tuple[Any, dict[str, Any]]:
            index, mb = xs
            base = state.rng if accum_steps == 1 else jax.random.fold_in(state.rng, index)
            rngs = step_rngs(base, state.step)
            total, metrics, stats, grads = loss_and_grads(state, task, mb, rngs, density_lambda)
            weight = metrics["weight"]
            grad_sum = jax.tree.map(lambda acc, g: acc + g * weight, grad_sum, grads)
            out = dict(metrics)
            out.update(jax.lax.stop_gradient(stats))
            out["total_loss"] = total
            return grad_sum, out

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grad_sum, stacked = jax.lax.scan(micro, zeros, (jnp.arange(accum_steps), batch))
        total_weight = jnp.maximum(jnp.sum(stacked["weight"]), 1e-9)
        grads = jax.tree.map(lambda g: g / total_weight, grad_sum)
        new_state = state.apply_gradients(grads=grads)
        out = _weighted_mean_metrics(stacked)
        out["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            out["learning_rate"] = schedule(state.step)
        return new_state, out

    return jax.jit(
        step,
        in_shardings=(replicated(mesh), micro_batch_sharding(mesh)),
        out_shardings=(replicated(mesh), replicated(mesh)),
        donate_argnums=0,
    )


def _per_example_density(mutables: Mapping[str, Any]) -> dict[str, Array]:
    """{module path: density [calls * batch, heads]} from the sown statistics."""
    flat = traverse_util.flatten_dict(dict(mutables.get(STATS_COLLECTION, {})))
    out = {}
    for path, values in sorted(flat.items()):
        if path[-1] != "density":
            continue
        values = values if isinstance(values, tuple) else (values,)
        out["/".join(str(p) for p in path[:-1])] = jnp.concatenate(
            [jnp.asarray(v, jnp.float32).reshape(-1, v.shape[-1]) for v in values], axis=0
        )
    return out


def make_detailed_eval_step(
    task: Task, mesh: Mesh
) -> Callable[[TrainState, Batch, Array], dict[str, Any]]:
    """``(state, batch, rng) -> sums``, jitted, no dropout (SBM graph sampling stays on).

    Returns weighted sums ``loss_sum``, ``correct_sum``, ``weight`` and, per attention
    module, density ``[heads]`` sums ``sum``, ``sumsq`` and ``count`` over the real
    examples (``example_mask``; all rows when absent).
    """

    def step(state: TrainState, batch: Batch, rng: Array) -> dict[str, Any]:
        logits, mutables = state.apply_fn(
            {"params": state.params},
            **task.model_inputs(batch),
            deterministic=True,
            rngs={"dropout": rng, "sample": rng},
            mutable=[STATS_COLLECTION],
        )
        _, metrics = task.loss_fn(logits, batch)
        weight = metrics["weight"]
        out: dict[str, Any] = {
            "loss_sum": metrics["loss"] * weight,
            "correct_sum": metrics["accuracy"] * weight,
            "weight": weight,
        }
        leading = next(iter(jax.tree.leaves(batch))).shape[0]
        example = batch.get("example_mask")
        example = jnp.ones((leading,), jnp.float32) if example is None else example
        example = example.astype(jnp.float32)
        density = {}
        for path, values in _per_example_density(mutables).items():
            rows = values.shape[0] // leading  # calls per example (2 for dual encoders)
            w = jnp.tile(example, rows)[:, None]
            density[path] = {
                "sum": jnp.sum(values * w, axis=0),
                "sumsq": jnp.sum(values**2 * w, axis=0),
                "count": jnp.sum(w) * jnp.ones(values.shape[-1]),
            }
        out["density"] = density
        return out

    return jax.jit(
        step,
        in_shardings=(replicated(mesh), NamedSharding(mesh, P("data")), replicated(mesh)),
        out_shardings=replicated(mesh),
    )


def evaluate_split(
    eval_step: Callable[[TrainState, Batch, Array], dict[str, Any]],
    state: TrainState,
    batches: Iterable[Batch],
    mesh: Mesh,
    rng: Array,
) -> dict[str, Any]:
    """Loss, accuracy and density of one split.

    Returns:
      ``loss``, ``accuracy`` (weighted means), ``examples`` (total weight), and where
      sown: ``density`` (mean over modules and heads of the per-example mean),
      ``density_per_head`` {module: {"mean": [heads], "std": [heads]}} with mean and
      standard deviation over the split's real examples.
    """
    totals: dict[str, Any] | None = None
    for i, batch in enumerate(batches):
        out = jax.device_get(eval_step(state, shard_batch(batch, mesh), jax.random.fold_in(rng, i)))
        totals = out if totals is None else jax.tree.map(np.add, totals, out)
    if totals is None:
        return {}
    weight = max(float(totals["weight"]), 1e-9)
    result: dict[str, Any] = {
        "loss": float(totals["loss_sum"]) / weight,
        "accuracy": float(totals["correct_sum"]) / weight,
        "examples": float(totals["weight"]),
    }
    if totals["density"]:
        per_head = {}
        for path, d in totals["density"].items():
            count = np.maximum(np.asarray(d["count"], np.float64), 1e-9)
            mean = np.asarray(d["sum"], np.float64) / count
            var = np.maximum(np.asarray(d["sumsq"], np.float64) / count - mean**2, 0.0)
            per_head[path] = {"mean": mean.tolist(), "std": np.sqrt(var).tolist()}
        result["density"] = float(np.mean([np.mean(v["mean"]) for v in per_head.values()]))
        result["density_per_head"] = per_head
    return result


def mesh_from_config(config: Any) -> Mesh:
    """1-axis ``data`` mesh over ``config.mesh.data`` devices (-1 or missing: all)."""
    mesh_cfg = config.get("mesh") or {}
    n = int(mesh_cfg.get("data", -1))
    available = jax.device_count()
    if n == -1:
        n = available
    if not 1 <= n <= available:
        raise ConfigError(f"mesh.data={n} must be -1 or between 1 and {available} (devices)")
    return make_mesh(n)


@functools.lru_cache(maxsize=8)
def _compiled_steps(
    task: TrainerTask,
    mesh: Mesh,
    density_lambda: float,
    accum: int,
    schedule_args: tuple[float, int, int, float],
) -> tuple[Any, Any]:
    """Jitted steps, reused when the same task object trains again (a resumed run in the
    same process does not recompile)."""
    lr, warmup, steps, end = schedule_args
    schedule = learning_rate_schedule(
        SimpleNamespace(
            learning_rate=lr, warmup_steps=warmup, num_steps=steps, end_learning_rate_factor=end
        )
    )
    train_step = make_accumulating_train_step(task, mesh, density_lambda, accum, schedule)
    return train_step, make_detailed_eval_step(task, mesh)


def _better(value: float, best: float | None, mode: str) -> bool:
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def _scalars(record: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the nested per-head entries (they go to the summary, not every log line)."""
    return {k: v for k, v in record.items() if not isinstance(v, Mapping) and k != "weight"}


def train_and_evaluate(
    config: Any,
    task: TrainerTask,
    output_dir: str | None = None,
    progress_stream: TextIO | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train ``config`` on ``task`` with dev evaluation, checkpoints and a test evaluation.

    Args:
      config: the full config (``seed``, ``model``, ``train``, ``checkpoint``, ``mesh``).
      task: the task; its ``eval_batches`` are the dev split.
      output_dir: the run's directory (default ``config.output_dir`` or
        ``runs/<config.name>``); an existing run there is resumed.
      progress_stream: where the progress bar goes (default stderr).
      stop_after: stop once ``state.step`` reaches this (simulates an interruption;
        the latest checkpoint is saved, no test evaluation, no summary). None: run to
        ``train.num_steps``.

    Returns:
      The summary (also written to summary.json), or, with ``stop_after`` below
      ``num_steps``, ``{"stopped_at": step, "output_dir": ...}``.
    """
    validate_config(config, head=task.head)
    train_cfg = config.train
    ckpt_cfg = config.get("checkpoint") or {}
    best_metric = str(ckpt_cfg.get("best_metric", "accuracy"))
    best_mode = str(ckpt_cfg.get("best_mode", "max"))
    if best_mode not in ("max", "min"):
        raise ConfigError(f"checkpoint.best_mode={best_mode!r} must be 'max' or 'min'")
    every = int(ckpt_cfg.get("every_steps", 1000))
    if every < 1:
        raise ConfigError(f"checkpoint.every_steps={every} must be >= 1")
    mesh = mesh_from_config(config)
    num_devices = mesh.devices.size
    batch_size = int(train_cfg.batch_size)
    accum = accumulation_steps(
        batch_size, num_devices, int(train_cfg.get("max_per_device_batch", 0))
    )
    num_steps = int(train_cfg.num_steps)
    until = num_steps if stop_after is None else min(int(stop_after), num_steps)
    eval_every = int(train_cfg.get("eval_every", 0))

    output_dir = prepare_output_dir(
        output_dir or str(config.get("output_dir") or "") or os.path.join("runs", config.name)
    )
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))

    model = build_model(config.model, task.head)
    first = next(task.train_batches(0))
    fresh = jax.device_put(create_train_state(config, model, task, first), replicated(mesh))
    checkpoints = RunCheckpoints(
        os.path.join(output_dir, "checkpoints"), int(ckpt_cfg.get("max_to_keep", 2))
    )
    meta: dict[str, Any] = {"best": None, "best_step": None, "wall_time_s": 0.0}
    restored = checkpoints.restore_latest(fresh)
    resumed_from = None
    state = fresh
    if restored is not None:
        state, meta = restored
        state = jax.device_put(state, replicated(mesh))
        resumed_from = int(state.step)
    start = int(state.step)

    train_step, eval_step = _compiled_steps(
        task,
        mesh,
        float(train_cfg.density_lambda),
        accum,
        (
            float(train_cfg.learning_rate),
            int(train_cfg.warmup_steps),
            num_steps,
            float(train_cfg.end_learning_rate_factor),
        ),
    )
    eval_rng = jax.random.PRNGKey(int(config.seed) + 1)
    writer = MetricsWriter(output_dir)
    progress = ProgressBar(num_steps, stream=progress_stream)
    log_every = int(train_cfg.log_every)
    t0 = time.perf_counter()
    wall_before = float(meta.get("wall_time_s") or 0.0)
    pending: list[tuple[int, Any]] = []
    first_done: tuple[int, float] | None = None
    last_train: dict[str, Any] = {}

    def meta_now() -> dict[str, Any]:
        return {**meta, "wall_time_s": wall_before + time.perf_counter() - t0}

    def flush() -> None:
        nonlocal first_done, last_train
        if not pending:
            return
        values = jax.device_get([m for _, m in pending])
        for (step, _), m in zip(pending, values, strict=True):
            rec = {"step": step, "split": "train", "time_s": time.perf_counter() - t0}
            rec.update(_scalars(to_python(m)))
            writer.write(rec)
            last_train = rec
        writer.flush()
        if first_done is None:
            first_done = (pending[0][0], time.perf_counter())
        progress.update(last_train["step"], last_train, force=last_train["step"] == until)
        pending.clear()

    def run_dev(step: int) -> None:
        if task.eval_batches is None:
            return
        result = evaluate_split(eval_step, state, task.eval_batches(), mesh, eval_rng)
        writer.write({"step": step, "split": "dev", **_scalars(result)})
        writer.flush()
        if best_metric not in result:
            raise ConfigError(
                f"checkpoint.best_metric={best_metric!r} is not a dev metric; "
                f"have {sorted(_scalars(result))}"
            )
        if _better(float(result[best_metric]), meta.get("best"), best_mode):
            meta["best"], meta["best_step"] = float(result[best_metric]), step
            checkpoints.save_best(state, meta_now())

    batches = task.train_batches(start)
    try:
        for step in range(start, until):
            batch = split_micro_batches(next(batches), accum)
            state, metrics = train_step(state, jax.device_put(batch, micro_batch_sharding(mesh)))
            done = step + 1
            pending.append((done, metrics))
            if first_done is None or done % log_every == 0 or done == until:
                flush()
            evaluated = (eval_every and done % eval_every == 0) or done == num_steps
            if evaluated:
                flush()
                run_dev(done)
            if evaluated or done % every == 0 or done == until:
                checkpoints.save_latest(state, meta_now())
        flush()
        loop_end = time.perf_counter()
        if until < num_steps:
            return {"stopped_at": until, "output_dir": output_dir}

        # Test evaluation at the best dev checkpoint (the last state if none).
        best = checkpoints.restore_best(fresh)
        test_state, test_step_no = state, int(state.step)
        if best is not None:
            test_state = jax.device_put(best[0], replicated(mesh))
            test_step_no = int(test_state.step)
        test_source = task.test_batches or task.eval_batches
        test = (
            evaluate_split(eval_step, test_state, test_source(), mesh, eval_rng)
            if test_source is not None
            else {}
        )
        writer.write({"step": test_step_no, "split": "test", **_scalars(test)})
    finally:
        progress.close()
        writer.close()
        checkpoints.close()

    steps_run = until - start
    rate = math.nan
    if first_done is not None and until - first_done[0] > 0:
        rate = (until - first_done[0]) / max(loop_end - first_done[1], 1e-9)
    summary = {
        "name": str(config.get("name", "run")),
        "task": str(config.task.name),
        "attention": str(config.model.attention),
        "seed": int(config.seed),
        "density_lambda": float(train_cfg.density_lambda),
        "steps": int(state.step),
        "steps_this_session": steps_run,
        "resumed_from": resumed_from,
        "test_step": test_step_no,
        "test_accuracy": test.get("accuracy"),
        "test_loss": test.get("loss"),
        "test_density": test.get("density"),
        "test_density_per_head": test.get("density_per_head"),
        "test_examples": test.get("examples"),
        "best_dev": meta.get("best"),
        "best_dev_metric": best_metric,
        "best_dev_step": meta.get("best_step"),
        "final_train": last_train,
        "wall_time_s": wall_before + (time.perf_counter() - t0),
        "steps_per_s": rate,
        "examples_per_s": rate * batch_size if math.isfinite(rate) else rate,
        "devices": num_devices,
        "accumulation_steps": accum,
        "output_dir": output_dir,
        "config": json.loads(config.to_json_best_effort()),
    }
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(to_python_json(summary), f, indent=2, sort_keys=True)
    return summary


def to_python_json(value: Any) -> Any:
    """NaN/inf -> None so the summary is strict JSON."""
    if isinstance(value, Mapping):
        return {k: to_python_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_run_summary(summary: Mapping[str, Any]) -> str:
    """One line: task, mechanism, test accuracy/density, best dev, steps, time."""

    def num(x: Any) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    if "stopped_at" in summary:
        return f"stopped at step {summary['stopped_at']} -> {summary['output_dir']}"
    return (
        f"{summary['task']} ({summary['attention']}, seed {summary['seed']}): "
        f"test accuracy {num(summary['test_accuracy'])} density "
        f"{num(summary['test_density'])} at step {summary['test_step']} | best dev "
        f"{num(summary['best_dev'])} | {summary['steps']} steps in "
        f"{summary['wall_time_s']:.1f} s -> {summary['output_dir']}"
    )
