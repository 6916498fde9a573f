"""Host loops over an evaluation split: metrics (``evaluate_split``) and predictions
(``predict_split``), each batch put on the mesh and run through a jitted step; and the
end of a run, ``evaluate_at_best``: the test splits and predictions at the best dev
checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from sbm_jax.training.checkpoints import RunCheckpoints, short_error
from sbm_jax.training.context import RunContext
from sbm_jax.training.host_data import put_global
from sbm_jax.training.sharding import data_axis_size
from sbm_jax.training.state import TrainState
from sbm_jax.training.steps import data_sharding
from sbm_jax.training.task import Batch

Array = jax.Array


def fit_to_mesh(batch: Batch, mesh: Mesh) -> dict[str, np.ndarray]:
    """``batch`` on the host, its rows padded up to a multiple of the mesh's data axis
    with filler rows (zeros, ``example_mask`` False; an ``example_mask`` of ones is added
    when the batch has none), so that any evaluation batch size shards evenly. Filler
    rows count nowhere: every metric is weighted by ``example_mask``."""
    host = {k: np.asarray(v) for k, v in batch.items()}
    rows = len(next(iter(host.values())))
    extra = -rows % data_axis_size(mesh)
    if not extra:
        return host
    real = host.pop("example_mask", np.ones(rows, bool)).astype(bool)
    out = {
        k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)]) for k, v in host.items()
    }
    out["example_mask"] = np.concatenate([real, np.zeros(extra, bool)])
    return out


def evaluate_split(
    eval_step: Callable[[TrainState, Batch, Array], dict[str, Any]],
    state: TrainState,
    batches: Iterable[Batch],
    mesh: Mesh,
    rng: Array,
    eval_metrics: Callable[[np.ndarray], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Loss, accuracy, density, overflow (and task metrics) of one split.

    Args:
      eval_step: ``make_eval_step``'s step.
      state, batches, mesh: what to evaluate, on which mesh.
      rng: batch ``i`` samples with ``fold_in(rng, i)``.
      eval_metrics: ``confusion -> metrics`` (``Task.eval_metrics``), when the step
        returns a confusion matrix.

    Returns:
      ``loss``, ``accuracy`` (weighted means), ``examples`` (real examples, filler rows
      left out), ``weight`` (the loss's total weight: examples, or the scored positions
      of a token task), and where
      sown: ``density`` (mean over modules and heads of the per-example mean),
      ``density_per_head`` {module: {"mean": [heads], "std": [heads]}} with mean and
      standard deviation over the split's real examples, ``overflow`` (graphs whose
      draws exceeded the largest capacity bucket) and ``overflow_per_layer``; plus
      ``eval_metrics(confusion)``. Empty for an empty split.
    """
    totals: dict[str, Any] | None = None
    for i, batch in enumerate(batches):
        sharded = put_global(fit_to_mesh(batch, mesh), data_sharding(mesh))
        out = jax.device_get(eval_step(state, sharded, jax.random.fold_in(rng, i)))
        totals = out if totals is None else jax.tree.map(np.add, totals, out)
    if totals is None:
        return {}
    weight = max(float(totals["weight"]), 1e-9)
    result: dict[str, Any] = {
        "loss": float(totals["loss_sum"]) / weight,
        "accuracy": float(totals["correct_sum"]) / weight,
        "examples": float(totals["examples"]),
        "weight": float(totals["weight"]),
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
    if totals.get("overflow"):
        per_layer = {k: float(v) for k, v in totals["overflow"].items()}
        result["overflow"] = float(sum(per_layer.values()))
        result["overflow_per_layer"] = per_layer
    if "confusion" in totals:
        confusion = np.rint(np.asarray(totals["confusion"], np.float64)).astype(np.int64)
        result["confusion"] = confusion.tolist()
        if eval_metrics is not None:
            result.update(eval_metrics(confusion))
    return result


def predict_split(
    predict_step: Callable[[TrainState, Batch, Array], Array],
    state: TrainState,
    batches: Iterable[Batch],
    mesh: Mesh,
    rng: Array,
) -> tuple[np.ndarray, np.ndarray]:
    """(index int64 [n], predicted class int64 [n]) of the real rows of ``batches``.

    Each batch carries ``index`` int [batch] (the example ids written out) and
    ``example_mask`` bool [batch] (False for filler rows).
    """
    indices, predictions = [], []
    for i, batch in enumerate(batches):
        host = fit_to_mesh(batch, mesh)
        real = host.get("example_mask", np.ones(len(host["index"]), bool)).astype(bool)
        device = {k: v for k, v in host.items() if k != "index"}
        sharded = put_global(device, data_sharding(mesh))
        predicted = np.asarray(
            jax.device_get(predict_step(state, sharded, jax.random.fold_in(rng, i)))
        )
        indices.append(host["index"][real].astype(np.int64))
        predictions.append(predicted[real].astype(np.int64))
    if not indices:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(indices), np.concatenate(predictions)


def evaluate_at_best(
    run: RunContext,
    checkpoints: RunCheckpoints,
    state: TrainState,
    restore_into: tuple[TrainState, Any],
    steps: tuple[Any, Any, Any],
    rng: Array,
) -> tuple[int, dict[str, dict[str, Any]], dict[str, str]]:
    """The test splits (the dev split when the task has none) and the task's predictions
    at the best dev checkpoint, or at ``state`` when there is none or it is unreadable
    (then set aside like a latest one, with a warning).

    Args:
      run, checkpoints: the session's.
      state: the last state; ``restore_into``: ``(target, shardings)`` a checkpoint
        restores into.
      steps: ``(train_step, eval_step, predict_step)``.
      rng: the evaluations' base key.

    Returns:
      ``(step tested, {split name: evaluate_split result}, {split: predictions file})``,
      the files written by process 0 (``task.write_predictions``).
    """
    task, mesh, log = run.task, run.mesh, run.log

    def best_unreadable(step: int, moved_to: str, error: Exception) -> None:
        log(
            f"warning: the best checkpoint (step {step}) is unreadable "
            f"({short_error(error)}); moved to {moved_to}, testing the last state"
        )

    _, eval_step, predict_step = steps
    target, shardings = restore_into
    best = checkpoints.restore_best(target, on_unreadable=best_unreadable)
    if best is not None:
        state = put_global(best[0], shardings)
    splits = dict(task.test_splits or {})
    if not splits and task.eval_batches is not None:
        splits = {"dev": task.eval_batches}
    tests = {
        name: evaluate_split(eval_step, state, batches(), mesh, rng, task.eval_metrics)
        for name, batches in splits.items()
    }
    predictions: dict[str, str] = {}
    if task.predict_splits and predict_step is not None:
        for name, batches in task.predict_splits.items():
            index, predicted = predict_split(predict_step, state, batches(), mesh, rng)
            if run.primary and task.write_predictions is not None:
                predictions[name] = task.write_predictions(name, index, predicted, run.output_dir)
    return int(state.step), tests, predictions
