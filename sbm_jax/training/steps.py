"""Jitted train and eval steps, sharded over a 1-axis ``data`` mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sbm_jax.attention import STATS_COLLECTION
from sbm_jax.training.state import TrainState
from sbm_jax.training.stats import collect_attention_stats
from sbm_jax.training.task import Batch, Task

Array = jax.Array
StepFn = Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]


def make_mesh(num_devices: int | None = None) -> Mesh:
    """1-axis mesh ``('data',)`` over the first ``num_devices`` devices (default all)."""
    n = jax.device_count() if num_devices is None else num_devices
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data``."""
    return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    """Same copy on every device."""
    return NamedSharding(mesh, P())


def shard_batch(batch: Batch, mesh: Mesh) -> dict[str, Array]:
    """Host batch -> device arrays split along the batch axis."""
    return jax.device_put(dict(batch), data_sharding(mesh))


def step_rngs(base: Array, step: Array) -> dict[str, Array]:
    dropout_rng, sample_rng = jax.random.split(jax.random.fold_in(base, step))
    return {"dropout": dropout_rng, "sample": sample_rng}


def _forward(
    state: TrainState,
    params: Any,
    task: Task,
    batch: Batch,
    rngs: dict[str, Array],
    deterministic: bool,
) -> tuple[Array, dict[str, Any], dict[str, Any]]:
    logits, mutables = state.apply_fn(
        {"params": params},
        **task.model_inputs(batch),
        deterministic=deterministic,
        rngs=rngs,
        mutable=[STATS_COLLECTION],
    )
    loss, metrics = task.loss_fn(logits, batch)
    return loss, metrics, collect_attention_stats(mutables)


def loss_and_grads(
    state: TrainState,
    task: Task,
    batch: Batch,
    rngs: dict[str, Array],
    density_lambda: float,
) -> tuple[Array, dict[str, Any], dict[str, Any], Any]:
    """Training objective on one batch: ``(total, metrics, stats, grads)``.

    ``total`` is the task loss plus ``density_lambda * mean density`` (the sown,
    differentiable density); ``grads`` are with respect to ``state.params``.
    """

    def objective(params: Any) -> tuple[Array, tuple[dict[str, Any], dict[str, Any]]]:
        loss, metrics, stats = _forward(state, params, task, batch, rngs, False)
        total = loss
        if "density" in stats and density_lambda:
            total = loss + density_lambda * stats["density"]
        return total, (metrics, stats)

    (total, (metrics, stats)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    return total, metrics, stats, grads


def make_train_step(
    task: Task, mesh: Mesh, density_lambda: float, schedule: optax.Schedule | None = None
) -> StepFn:
    """``(state, batch) -> (state, metrics)``, jitted; the state is donated.

    The loss is the task loss plus ``density_lambda * mean density`` (the sown,
    differentiable density), with rng streams ``dropout`` and ``sample`` from
    ``fold_in(state.rng, state.step)``.
    """

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        rngs = step_rngs(state.rng, state.step)
        total, metrics, stats, grads = loss_and_grads(state, task, batch, rngs, density_lambda)
        new_state = state.apply_gradients(grads=grads)
        out = dict(metrics)
        out.update(jax.lax.stop_gradient(stats))
        out["total_loss"] = total
        out["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            out["learning_rate"] = schedule(state.step)
        return new_state, out

    return jax.jit(
        step,
        in_shardings=(replicated(mesh), data_sharding(mesh)),
        out_shardings=(replicated(mesh), replicated(mesh)),
        donate_argnums=0,
    )


def make_eval_step(task: Task, mesh: Mesh) -> Callable[[TrainState, Batch, Array], dict[str, Any]]:
    """``(state, batch, rng) -> metrics``, jitted, no dropout (graph sampling stays on)."""

    def step(state: TrainState, batch: Batch, rng: Array) -> dict[str, Any]:
        rngs = {"dropout": rng, "sample": rng}
        _, metrics, stats = _forward(state, state.params, task, batch, rngs, True)
        return {**metrics, **stats}

    return jax.jit(
        step,
        in_shardings=(replicated(mesh), data_sharding(mesh), replicated(mesh)),
        out_shardings=replicated(mesh),
    )


def evaluate(
    eval_step: Callable[[TrainState, Batch, Array], dict[str, Any]],
    state: TrainState,
    batches: Any,
    mesh: Mesh,
    rng: Array,
) -> dict[str, float]:
    """Weighted mean of loss and accuracy (and plain mean of density, edges) over batches."""
    totals: dict[str, float] = {}
    weight = 0.0
    count = 0
    for i, batch in enumerate(batches):
        metrics = jax.device_get(
            eval_step(state, shard_batch(batch, mesh), jax.random.fold_in(rng, i))
        )
        w = float(metrics["weight"])
        weight += w
        count += 1
        for key in ("loss", "accuracy"):
            totals[key] = totals.get(key, 0.0) + float(metrics[key]) * w
        for key in ("density", "edges"):
            if key in metrics:
                totals[key] = totals.get(key, 0.0) + float(metrics[key])
    if count == 0:
        return {}
    out = {k: totals[k] / max(weight, 1e-9) for k in ("loss", "accuracy")}
    out.update({k: totals[k] / count for k in ("density", "edges") if k in totals})
    return out
