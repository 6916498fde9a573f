"""The jitted steps: train (accumulated over micro-batches, with the non-finite guard),
evaluate (weighted sums, per-head density, confusion) and predict; ``compiled_steps``,
a run's three, built once per task.

Rng streams: step ``s`` draws ``dropout`` and ``sample`` from ``fold_in(state.rng, s)``
(micro-batch ``i`` of an accumulated step from ``fold_in(fold_in(state.rng, i), s)``), so
the state alone fixes every later step and a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sbm_jax.attention import STATS_COLLECTION
from sbm_jax.training.sharding import DATA_AXIS, StateShardedJit
from sbm_jax.training.state import ScheduleArgs, TrainState, learning_rate_schedule
from sbm_jax.training.stats import collect_attention_stats, sown_per_module
from sbm_jax.training.task import Batch, Task

Array = jax.Array
StepFn = Callable[[TrainState, Batch], tuple[TrainState, dict[str, Any]]]

# Metrics summed over micro-batches (counts), not averaged.
SUMMED_METRICS = ("weight", "overflow", "overflow_per_layer")


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data``."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """Same copy on every device."""
    return NamedSharding(mesh, P())


def micro_batch_sharding(mesh: Mesh) -> NamedSharding:
    """[accum, micro, ...]: micro-batch rows split over ``data`` (replicated over any
    other mesh axis)."""
    return NamedSharding(mesh, P(None, DATA_AXIS))


def shard_batch(batch: Batch, mesh: Mesh) -> dict[str, Array]:
    """Host batch -> device arrays split along the batch axis (one process)."""
    return jax.device_put(dict(batch), data_sharding(mesh))


def step_rngs(base: Array, step: Array) -> dict[str, Array]:
    dropout_rng, sample_rng = jax.random.split(jax.random.fold_in(base, step))
    return {"dropout": dropout_rng, "sample": sample_rng}


def _apply(
    state: TrainState,
    params: Any,
    task: Task,
    batch: Batch,
    rngs: dict[str, Array],
    deterministic: bool,
) -> tuple[Array, dict[str, Any]]:
    """(logits, sown attention statistics collection)."""
    logits, mutables = state.apply_fn(
        {"params": params},
        **task.model_inputs(batch),
        deterministic=deterministic,
        rngs=rngs,
        mutable=[STATS_COLLECTION],
    )
    return logits, mutables


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
        logits, mutables = _apply(state, params, task, batch, rngs, False)
        loss, metrics = task.loss_fn(logits, batch)
        stats = collect_attention_stats(mutables)
        total = loss
        if "density" in stats and density_lambda:
            total = loss + density_lambda * stats["density"]
        return total, (metrics, stats)

    (total, (metrics, stats)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    return total, metrics, stats, grads


def _combine_micro_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics stacked over micro-batches [A, ...] -> one set: ``loss``/``accuracy``
    weighted by ``weight``, counts (``SUMMED_METRICS``) summed, the rest averaged."""
    weight = metrics["weight"]
    total = jnp.maximum(jnp.sum(weight), 1e-9)
    out = {}
    for key, value in metrics.items():
        if key in ("loss", "accuracy"):
            out[key] = jnp.sum(value * weight) / total
        elif key in SUMMED_METRICS:
            out[key] = jax.tree.map(lambda v: jnp.sum(v, axis=0), value)
        else:
            out[key] = jax.tree.map(lambda v: jnp.mean(v, axis=0), value)
    return out


def make_train_step(
    task: Task,
    mesh: Mesh,
    density_lambda: float,
    *,
    accum_steps: int = 1,
    schedule: optax.Schedule | None = None,
    guard_nonfinite: bool = False,
) -> Callable[..., Any]:
    """``(state, batch [A, micro, ...]) -> (state, metrics)``, jitted; state donated
    (``host_data.split_micro_batches`` lays a host batch out as ``[A, micro, ...]``).

    Each micro-batch ``i`` gives ``grad_i`` of (task loss + ``density_lambda`` x mean
    density); the update uses ``sum_i w_i grad_i / sum_i w_i`` with ``w_i`` the
    micro-batch's ``weight`` metric. For the task loss (a weighted mean over positions)
    this is exactly the gradient of the whole batch's loss; the density term gets the
    same weights, i.e. the plain mean when micro-batches weigh the same. With ``A = 1``
    it is the plain data-parallel step: one pass, the step's rng streams from
    ``state.rng`` itself. Metrics: the task's, the attention statistics,
    ``total_loss`` (with the density term), ``grad_norm``, ``finite`` and, with a
    ``schedule``, ``learning_rate``.

    With ``guard_nonfinite`` the step is ``(state, batch, halted) -> (state, metrics,
    halted)``: ``halted`` is a replicated bool scalar; the step is ``ok`` when every
    micro-batch's objective and the gradient norm are finite (``metrics["finite"]``);
    the update (step counter included) applies only when ``ok and not halted``, and the
    returned ``halted`` is ``halted or not ok``. So after a bad step the state stays the
    one before it, with no host sync.

    The state goes in and out with ``state_sharding(state, mesh)`` (per-head attention
    parameters split over a ``heads`` axis, the rest replicated); the metrics come out
    replicated.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps} must be >= 1")

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        def micro(grad_sum: Any, xs: tuple[Array, Batch]) -> tuple[Any, dict[str, Any]]:
            index, mb = xs
            base = state.rng if accum_steps == 1 else jax.random.fold_in(state.rng, index)
            rngs = step_rngs(base, state.step)  # type: ignore[arg-type]
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
        out = _combine_micro_metrics(stacked)
        out["grad_norm"] = optax.tree.norm(grads)
        out["finite"] = (
            jnp.all(jnp.isfinite(stacked["total_loss"]))
            & jnp.all(jnp.isfinite(stacked["loss"]))
            & jnp.isfinite(out["grad_norm"])
        )
        if schedule is not None:
            out["learning_rate"] = schedule(state.step)
        return new_state, out

    batches, rep = micro_batch_sharding(mesh), replicated(mesh)
    if not guard_nonfinite:
        return StateShardedJit(
            step,
            mesh,
            in_shardings=lambda s: (s, batches),
            out_shardings=lambda s: (s, rep),
            donate_argnums=0,
        )

    def guarded(
        state: TrainState, batch: Batch, halted: Array
    ) -> tuple[TrainState, dict[str, Any], Array]:
        new_state, out = step(state, batch)
        apply = out["finite"] & ~halted
        kept = jax.tree.map(lambda new, old: jnp.where(apply, new, old), new_state, state)
        return kept, out, halted | ~out["finite"]

    return StateShardedJit(
        guarded,
        mesh,
        in_shardings=lambda s: (s, batches, rep),
        out_shardings=lambda s: (s, rep, rep),
        donate_argnums=0,
    )


def _example_weights(batch: Batch, leading: int) -> Array:
    """float32 [batch]: ``example_mask`` (1 for real rows), all ones when absent."""
    example = batch.get("example_mask")
    if example is None:
        return jnp.ones((leading,), jnp.float32)
    return example.astype(jnp.float32)


def make_eval_step(task: Task, mesh: Mesh) -> Callable[[TrainState, Batch, Array], dict[str, Any]]:
    """``(state, batch, rng) -> sums``, jitted, no dropout (SBM graph sampling stays on).

    Returns weighted sums ``loss_sum``, ``correct_sum``, ``weight`` and the count of
    real examples ``examples`` (rows; ``weight`` counts positions for token tasks); per attention
    module, density ``[heads]`` sums ``sum``, ``sumsq`` and ``count`` over the real
    examples (``example_mask``; all rows when absent); ``overflow`` (graphs whose draws
    exceeded the largest capacity bucket) per module; and with
    ``task.confusion_classes = C`` a ``confusion [C, C]`` (true x predicted) of the real
    examples. The state comes in with ``state_sharding(state, mesh)``, the batch split
    over ``data``.
    """
    classes = int(task.confusion_classes)

    def step(state: TrainState, batch: Batch, rng: Array) -> dict[str, Any]:
        rngs = {"dropout": rng, "sample": rng}
        logits, mutables = _apply(state, state.params, task, batch, rngs, True)
        _, metrics = task.loss_fn(logits, batch)
        weight = metrics["weight"]
        out: dict[str, Any] = {
            "loss_sum": metrics["loss"] * weight,
            "correct_sum": metrics["accuracy"] * weight,
            "weight": weight,
        }
        leading = next(iter(jax.tree.leaves(batch))).shape[0]
        example = _example_weights(batch, leading)
        out["examples"] = jnp.sum(example)
        sown = mutables.get(STATS_COLLECTION, {})
        density = {}
        for path, values in sown_per_module(sown, "density").items():
            rows = values.shape[0] // leading  # calls per example (2 for dual encoders)
            w = jnp.tile(example, rows)[:, None]
            density[path] = {
                "sum": jnp.sum(values * w, axis=0),
                "sumsq": jnp.sum(values**2 * w, axis=0),
                "count": jnp.sum(w) * jnp.ones(values.shape[-1]),
            }
        out["density"] = density
        overflow = {}
        for path, values in sown_per_module(sown, "overflow").items():
            rows = values.shape[0] // leading
            overflow[path] = jnp.sum((values > 0) * jnp.tile(example, rows)[:, None])
        out["overflow"] = overflow
        if classes:
            predicted = jax.nn.one_hot(jnp.argmax(logits, axis=-1), classes)
            true = jax.nn.one_hot(batch["targets"], classes)
            out["confusion"] = jnp.einsum("b,bi,bj->ij", example, true, predicted)
        return out

    rep = replicated(mesh)
    return StateShardedJit(
        step,
        mesh,
        in_shardings=lambda s: (s, data_sharding(mesh), rep),
        out_shardings=lambda s: rep,
    )


def make_predict_step(task: Task, mesh: Mesh) -> Callable[[TrainState, Batch, Array], Array]:
    """``(state, batch, rng) -> argmax class int32 [batch]``, jitted, no dropout."""

    def step(state: TrainState, batch: Batch, rng: Array) -> Array:
        rngs = {"dropout": rng, "sample": rng}
        logits, _ = _apply(state, state.params, task, batch, rngs, True)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    rep = replicated(mesh)
    return StateShardedJit(
        step,
        mesh,
        in_shardings=lambda s: (s, data_sharding(mesh), rep),
        out_shardings=lambda s: rep,
    )


@functools.lru_cache(maxsize=8)
def compiled_steps(
    task: Task,
    mesh: Mesh,
    density_lambda: float,
    accum: int,
    schedule: ScheduleArgs,
    guard_nonfinite: bool = False,
) -> tuple[Any, Any, Any]:
    """``(train_step, eval_step, predict_step or None)`` of a run, reused when the same
    task object trains again (a resumed run in the same process does not recompile)."""
    train_step = make_train_step(
        task,
        mesh,
        density_lambda,
        accum_steps=accum,
        schedule=learning_rate_schedule(*schedule),
        guard_nonfinite=guard_nonfinite,
    )
    predict = make_predict_step(task, mesh) if task.predict_splits else None
    return train_step, make_eval_step(task, mesh), predict
