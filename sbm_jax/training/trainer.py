"""The full trainer: sharded steps with gradient accumulation, dev evaluation, best-dev
and latest orbax checkpoints, resume, test evaluation at the best checkpoint, metrics
and a JSON run summary.

It is built on the shared loop's pieces (``TrainState``, ``create_train_state``,
``MetricsWriter``, ``ProgressBar``, ``validate_config``) and knows nothing task-specific:
a task is a ``TrainerTask`` (a ``Task`` with a test split too). LRA registers five; GLUE
can reuse it as is.

Config fields read beyond those of ``run_training``:
``train.max_per_device_batch`` (gradient accumulation), ``train.eval_every``,
``train.halt_on_nonfinite`` (default True: see "Non-finite steps" below),
``checkpoint.{every_steps, max_to_keep, best_metric, best_mode}``, ``mesh.data``,
``mesh.heads``.

Mesh and sharding: the mesh is ``("data", "heads")`` of shape ``(mesh.data,
mesh.heads)`` (``mesh_from_config``). Batches are split over ``data``; the train state
is replicated except the per-head attention parameters (and their Adam moments), which
are split over ``heads`` (``sbm_jax.training.sharding``), so each device runs the
attention, and SBM's graph sampling, of its own heads for its own examples.

Files written into the output directory: ``config.json``, ``metrics.jsonl`` (one record
per train step, plus ``split`` "dev" / "test" records), ``metrics.csv``,
``checkpoints/{latest,best}/<step>/`` and ``summary.json``. Running again with the same
output directory resumes from the latest checkpoint (or, if the run is complete, only
redoes the test evaluation and the summary). Metrics also go to TensorBoard event
files in ``<output_dir>/tensorboard/`` (tags ``train/loss``, ``dev/accuracy``,
``test/accuracy``, ...; a resumed run adds a new event file), viewable with
``tensorboard --logdir runs/``; ``scripts/plot_metrics.py`` plots ``metrics.jsonl``.

Batch layout: a global batch of ``B`` rows is split into ``A`` micro-batches of ``B / A``
rows (rows ``i*B/A .. (i+1)*B/A - 1`` form micro-batch ``i``); each micro-batch is split
over the mesh's ``data`` axis. ``A`` is the smallest count that keeps every device at or
under ``train.max_per_device_batch`` examples per pass.

Resume and preemption: the training order is random access by step (``train_batches(s)``
starts at the batch of step ``s``), so the checkpointed step *is* the data iterator's
state; every checkpoint's meta records it as ``data_index`` (and ``batch_size``), and a
resume checks both. While ``train_and_evaluate`` runs (in the main thread) SIGTERM and
SIGINT finish the current step, save the latest checkpoint, flush the metrics and return
``{"stopped_at": step, "output_dir": ..., "reason": "SIGTERM"}``; a second signal acts
as it would have without the trainer. With several processes the signal is acted on at
the next ``train.log_every`` boundary, by all processes together.

Non-finite steps (``train.halt_on_nonfinite``, default True): the jitted step checks the
loss and the global gradient norm and keeps a device-side sticky ``halted`` flag; from
the first bad step on, updates are skipped (the state stays the one *before* that step),
with no host sync per step. At the next metrics flush the trainer finds the first bad
step ``s`` and writes ``nonfinite/step_<s>/``: ``state/<s-1>/`` (orbax), ``batch.npz``
(the step's batch; one ``batch_process<k>.npz`` per process in multi-process jobs) and
``info.json`` (step, data_index, loss, grad norm, rng, how to replay), then raises
``NonFiniteError``. ``replay_nonfinite(directory, config, task)`` recomputes that step.

Multi-process (``jax.process_count() > 1``): each process feeds only the rows of every
global batch that land on its devices (``process_train_rows``): the task's
``process_train_batches(start, rows)`` reads just those (LRA does), otherwise they are cut
from ``train_batches``. The global arrays are assembled with
``jax.make_array_from_process_local_data``; the global batch, and so every loss, is the
same as in one process. Only process 0 writes ``config.json``, the metrics files,
``summary.json`` and the progress bar; every process takes part in the orbax saves and
restores.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
from sbm_jax.training.checkpoints import RunCheckpoints, restore_snapshot, save_snapshot
from sbm_jax.training.config_checks import ConfigError, prepare_output_dir, validate_config
from sbm_jax.training.metrics import MetricsWriter, ProgressBar, to_python
from sbm_jax.training.sharding import (
    DATA_AXIS,
    StateShardedJit,
    data_axis_size,
    make_data_heads_mesh,
    state_sharding,
)
from sbm_jax.training.state import TrainState, create_train_state, learning_rate_schedule
from sbm_jax.training.steps import (
    data_sharding,
    loss_and_grads,
    make_mesh,
    replicated,
    step_rngs,
)
from sbm_jax.training.task import Batch, Task

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TrainerTask(Task):
    """A ``Task`` whose ``eval_batches`` are the dev split, plus a held-out test split.

    Attributes:
      test_batches: ``() -> iterable`` of test batches (None: evaluate dev at the end).
      process_train_batches: ``(start_step, rows) -> iterator`` of the rows ``rows``
        (global row indices, int [n]) of each training batch from ``start_step`` on, in
        the order given: what one process of a multi-process job reads. None: the rows
        are cut from ``train_batches`` (every process then reads whole batches).
    Batches may carry ``example_mask`` bool [batch] (False for filler rows); the
    density statistics of evaluations skip those rows.
    """

    test_batches: Callable[[], Iterable[Batch]] | None = None
    process_train_batches: Callable[[int, np.ndarray], Iterator[Batch]] | None = None


class NonFiniteError(RuntimeError):
    """A training step gave a non-finite loss or gradient norm.

    Attributes:
      step: the first bad step (as numbered in ``metrics.jsonl``: the update that would
        have taken ``state.step`` from ``step - 1`` to ``step``).
      directory: where its state, batch and info were saved (``replay_nonfinite``).
    """

    def __init__(self, message: str, step: int, directory: str) -> None:
        super().__init__(message)
        self.step = step
        self.directory = directory


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
    """[accum, micro, ...]: micro-batch rows split over ``data`` (replicated over any
    other mesh axis)."""
    return NamedSharding(mesh, P(None, DATA_AXIS))


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
    guard_nonfinite: bool = False,
) -> Callable[..., Any]:
    """``(state, batch [A, micro, ...]) -> (state, metrics)``, jitted; state donated.

    Each micro-batch ``i`` gives ``grad_i`` of (task loss + ``density_lambda`` x mean
    density); the update uses ``sum_i w_i grad_i / sum_i w_i`` with ``w_i`` the
    micro-batch's ``weight`` metric. For the task loss (a weighted mean over positions)
    this is exactly the gradient of the whole batch's loss; the density term gets the
    same weights, i.e. the plain mean when micro-batches weigh the same. With ``A = 1``
    this is the shared loop's ``make_train_step`` (same rng streams).

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


def process_train_rows(batch_size: int, accum: int, mesh: Mesh) -> np.ndarray:
    """Rows of a global batch that this process feeds, in its local batch's order.

    The global batch [B] becomes [A, B / A] (``split_micro_batches``) sharded as
    ``micro_batch_sharding``; this process's devices hold columns ``c0..c1`` of every
    micro-batch, i.e. global rows ``i * B / A + c`` for ``i < A``, ``c0 <= c < c1``, listed
    micro-batch by micro-batch (so the local rows reshape to [A, c1 - c0]). One process:
    ``arange(B)``. The rows are split over the mesh's ``data`` axis only: devices that
    differ only in their ``heads`` coordinate hold the same rows.

    Raises:
      ConfigError naming train.batch_size when the rows do not split over the devices.
    """
    if batch_size % accum:
        raise ConfigError(f"train.batch_size={batch_size} is not a multiple of {accum} passes")
    micro = batch_size // accum
    data = data_axis_size(mesh)
    if micro % data:
        raise ConfigError(
            f"train.batch_size={batch_size} / {accum} passes is not a multiple of the "
            f"{data} devices of the mesh's data axis"
        )
    indices = micro_batch_sharding(mesh).addressable_devices_indices_map((accum, micro))
    cols: set[int] = set()
    for index in indices.values():
        cols.update(range(*index[1].indices(micro)))
    ordered = sorted(cols)
    if ordered != list(range(ordered[0], ordered[-1] + 1)):
        raise ValueError(f"this process's devices hold non-contiguous batch rows {ordered}")
    return np.asarray([i * micro + c for i in range(accum) for c in ordered], np.int64)


def _put_global(tree: Any, sharding: Any) -> Any:
    """Host values (the same in every process) -> global arrays with ``sharding`` (one
    ``NamedSharding`` for every leaf, or a pytree of them shaped like ``tree``)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def one(x: Any, leaf_sharding: NamedSharding) -> Array:
        if isinstance(x, jax.Array) and x.sharding == leaf_sharding:
            return x
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, leaf_sharding, lambda idx: value[idx])

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, sharding), tree)
    return jax.tree.map(one, tree, sharding)


def _local_data_slices(mesh: Mesh) -> int:
    """How many positions of the mesh's ``data`` axis this process has a device in."""
    names = list(mesh.axis_names)
    devices = mesh.devices
    if DATA_AXIS in names:
        devices = np.moveaxis(devices, names.index(DATA_AXIS), 0)
    rows = devices.reshape(devices.shape[0], -1) if devices.ndim else devices.reshape(1, 1)
    me = jax.process_index()
    return sum(any(d.process_index == me for d in row) for row in rows)


def _put_micro_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, Array]:
    """This process's rows [A, micro_local, ...] -> global [A, micro, ...] arrays."""
    sharding = micro_batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    per_process = {v.shape[1] for v in local.values()}
    if len(per_process) != 1:
        raise ValueError(f"batch entries disagree on their rows: {sorted(per_process)}")
    micro = data_axis_size(mesh) * per_process.pop() // _local_data_slices(mesh)
    return {
        key: jax.make_array_from_process_local_data(
            sharding, value, (value.shape[0], micro, *value.shape[2:])
        )
        for key, value in local.items()
    }


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
    examples (``example_mask``; all rows when absent). The state comes in with
    ``state_sharding(state, mesh)``, the batch split over ``data``.
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

    rep = replicated(mesh)
    return StateShardedJit(
        step,
        mesh,
        in_shardings=lambda s: (s, NamedSharding(mesh, P(DATA_AXIS)), rep),
        out_shardings=lambda s: rep,
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
        sharded = _put_global(dict(batch), data_sharding(mesh))
        out = jax.device_get(eval_step(state, sharded, jax.random.fold_in(rng, i)))
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


def _mesh_int(mesh_cfg: Any, name: str, default: int) -> int:
    value = mesh_cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"mesh.{name}={value!r} must be an integer")
    return int(value)


def mesh_from_config(config: Any) -> Mesh:
    """Mesh ``("data", "heads")`` of shape ``(mesh.data, mesh.heads)``.

    ``mesh.heads`` (default 1) devices split the attention heads; ``mesh.data`` (default
    -1: all devices / ``mesh.heads``) split the batch; the mesh takes the first
    ``data * heads`` devices. With ``heads = 1`` this is the data-parallel layout.

    Raises:
      ConfigError naming ``mesh.heads``, ``mesh.data`` or ``model.num_heads``: a size
      below 1, more devices than there are, ``mesh.data=-1`` with a ``mesh.heads`` that
      does not divide the device count, or a ``mesh.heads`` that does not divide
      ``model.num_heads``.
    """
    mesh_cfg = config.get("mesh") or {}
    data = _mesh_int(mesh_cfg, "data", -1)
    heads = _mesh_int(mesh_cfg, "heads", 1)
    available = jax.device_count()
    if not 1 <= heads <= available:
        raise ConfigError(f"mesh.heads={heads} must be between 1 and {available} (devices)")
    if data == -1:
        if available % heads:
            raise ConfigError(
                f"mesh.heads={heads} does not divide the {available} devices (mesh.data=-1 "
                "uses all of them); set mesh.data explicitly or change mesh.heads"
            )
        data = available // heads
    if data < 1:
        raise ConfigError(f"mesh.data={data} must be -1 or >= 1")
    if data * heads > available:
        raise ConfigError(
            f"mesh.data={data} x mesh.heads={heads} = {data * heads} devices, more than the "
            f"{available} available"
        )
    if heads > 1:
        model = config.get("model") or {}
        num_heads = model.get("num_heads")
        if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
            raise ConfigError(
                f"model.num_heads={num_heads!r} must be an integer when mesh.heads={heads}"
            )
        if int(num_heads) % heads:
            raise ConfigError(
                f"mesh.heads={heads} must divide model.num_heads={num_heads} (each device "
                "holds the same number of heads)"
            )
    return make_data_heads_mesh(data, heads)


@functools.lru_cache(maxsize=8)
def _compiled_steps(
    task: TrainerTask,
    mesh: Mesh,
    density_lambda: float,
    accum: int,
    schedule_args: tuple[float, int, int, float],
    guard_nonfinite: bool = False,
) -> tuple[Any, Any]:
    """Jitted steps, reused when the same task object trains again (a resumed run in the
    same process does not recompile)."""
    lr, warmup, steps, end = schedule_args
    schedule = learning_rate_schedule(
        SimpleNamespace(
            learning_rate=lr, warmup_steps=warmup, num_steps=steps, end_learning_rate_factor=end
        )
    )
    train_step = make_accumulating_train_step(
        task, mesh, density_lambda, accum, schedule, guard_nonfinite
    )
    return train_step, make_detailed_eval_step(task, mesh)


def _better(value: float, best: float | None, mode: str) -> bool:
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def _scalars(record: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the nested per-head entries (they go to the summary, not every log line)."""
    return {k: v for k, v in record.items() if not isinstance(v, Mapping) and k != "weight"}


class _NullWriter:
    """Metrics sink of the non-primary processes."""

    def write(self, record: Mapping[str, Any]) -> None:
        del record

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _NullProgress:
    """Progress bar of the non-primary processes."""

    def update(self, step: int, metrics: Mapping[str, Any], force: bool = False) -> None:
        del step, metrics, force

    def close(self) -> None:
        pass


class StopSignals:
    """Context manager: SIGTERM and SIGINT set ``received`` (the signal's name) instead of
    ending the process, so the loop can checkpoint and return.

    Only installed in the main thread (elsewhere ``signal.signal`` is not allowed), and
    not for a signal whose current handler is ``SIG_IGN``. A second signal of a kind
    restores the previous handler and delivers the signal to it. The previous handlers
    come back on exit.
    """

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            signum = getattr(signal, name)
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            return
        previous = self._previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def _any_process(flag: bool) -> bool:
    """True when ``flag`` is set in any process (a collective: all must call it)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


def _json_float(value: Any) -> float | str | None:
    """A float for JSON: finite as is, non-finite as "nan" / "inf" / "-inf"."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _batch_file(process_index: int, process_count: int) -> str:
    return "batch.npz" if process_count == 1 else f"batch_process{process_index}.npz"


def _dump_nonfinite(
    output_dir: str,
    record: Mapping[str, Any],
    state: TrainState,
    host_batch: Mapping[str, Any],
    rows: np.ndarray,
    accum: int,
    batch_size: int,
) -> NonFiniteError:
    """Save the state before bad step ``record["step"]``, its batch and info; the error."""
    step = int(record["step"])
    directory = os.path.abspath(os.path.join(output_dir, "nonfinite", f"step_{step}"))
    os.makedirs(directory, exist_ok=True)
    state_dir = save_snapshot(
        os.path.join(directory, "state"), state, {"data_index": step - 1, "step": step}
    )
    batch_file = _batch_file(jax.process_index(), jax.process_count())
    np.savez(
        os.path.join(directory, batch_file),
        **{k: np.asarray(v) for k, v in host_batch.items()},
        __rows__=rows,
    )
    info = {
        "step": step,
        "state_step": step - 1,
        "data_index": step - 1,
        "loss": _json_float(record.get("loss")),
        "total_loss": _json_float(record.get("total_loss")),
        "grad_norm": _json_float(record.get("grad_norm")),
        "accumulation_steps": accum,
        "batch_size": batch_size,
        "process_count": jax.process_count(),
        "rng": np.asarray(jax.random.key_data(state.rng)).tolist(),
        "step_rngs": "dropout, sample = split(fold_in(rng, state_step)); with several "
        "micro-batches, micro-batch i uses fold_in(rng, i) as its base",
        "files": {
            "state": state_dir,
            "batch": [_batch_file(i, jax.process_count()) for i in range(jax.process_count())],
        },
        "replay": "from sbm_jax.training.trainer import replay_nonfinite; "
        f"replay_nonfinite({directory!r}, config, task)",
    }
    if jax.process_index() == 0:
        with open(os.path.join(directory, "info.json"), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, sort_keys=True)
    message = (
        f"non-finite loss or gradient at step {step} (loss={info['loss']}, "
        f"grad_norm={info['grad_norm']}); training stopped with the state before that step. "
        f"Saved for replay in {directory}: state/{step - 1}/ (orbax), "
        f"{batch_file} (the step's batch, data_index {step - 1}), info.json. Replay with "
        f"replay_nonfinite({directory!r}, config, task); set train.halt_on_nonfinite=False "
        "to train through such steps."
    )
    return NonFiniteError(message, step, directory)


def replay_nonfinite(directory: str, config: Any, task: Task) -> dict[str, Any]:
    """Recompute a step saved by a ``NonFiniteError`` (``nonfinite/step_<s>/``).

    Restores the state from before step ``s``, loads its batch (all processes' rows, put
    back in global order) and runs the same (unguarded) accumulating step, with the same
    rng and micro-batches, on one device.

    Args:
      directory: the dump's directory (``NonFiniteError.directory``).
      config: the run's config (model and train sections as when it failed).
      task: the run's task (its loss and model inputs).

    Returns:
      ``{"step", "data_index", "state_step", "loss", "total_loss", "grad_norm",
      "finite"}`` of the replayed step (floats may be nan/inf).
    """
    with open(os.path.join(directory, "info.json"), encoding="utf-8") as f:
        info = json.load(f)
    parts = []
    for name in info["files"]["batch"]:
        with np.load(os.path.join(directory, name)) as data:
            parts.append({k: data[k] for k in data.files})
    rows = np.concatenate([p.pop("__rows__") for p in parts])
    order = np.argsort(rows)
    batch = {k: np.concatenate([p[k] for p in parts])[order] for k in parts[0]}
    if not np.array_equal(rows[order], np.arange(int(info["batch_size"]))):
        raise ValueError(f"{directory}: the saved batch files do not hold every row once")
    mesh = make_mesh(1)
    model = build_model(config.model, task.head)
    fresh = jax.device_put(create_train_state(config, model, task, batch), replicated(mesh))
    state, _ = restore_snapshot(os.path.join(directory, "state"), fresh)
    accum = int(info["accumulation_steps"])
    step_fn = make_accumulating_train_step(
        task, mesh, float(config.train.density_lambda), accum, None
    )
    _, metrics = step_fn(
        state, jax.device_put(split_micro_batches(batch, accum), micro_batch_sharding(mesh))
    )
    metrics = jax.device_get(metrics)
    return {
        "step": int(info["step"]),
        "data_index": int(info["data_index"]),
        "state_step": int(info["state_step"]),
        "loss": float(metrics["loss"]),
        "total_loss": float(metrics["total_loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "finite": bool(metrics["finite"]),
    }


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
      The summary (also written to summary.json), or, when stopped early,
      ``{"stopped_at": step, "output_dir": ..., "reason": ...}`` with reason
      ``"stop_after"``, ``"SIGTERM"`` or ``"SIGINT"`` (the latest checkpoint holds
      ``step``; running again resumes).

    Raises:
      NonFiniteError: a non-finite loss or gradient (``train.halt_on_nonfinite``).
      ConfigError: a bad config field, or a checkpoint that does not fit the config.
    """
    mesh = mesh_from_config(config)
    validate_config(config, head=task.head, device_count=data_axis_size(mesh))
    train_cfg = config.train
    ckpt_cfg = config.get("checkpoint") or {}
    best_metric = str(ckpt_cfg.get("best_metric", "accuracy"))
    best_mode = str(ckpt_cfg.get("best_mode", "max"))
    if best_mode not in ("max", "min"):
        raise ConfigError(f"checkpoint.best_mode={best_mode!r} must be 'max' or 'min'")
    every = int(ckpt_cfg.get("every_steps", 1000))
    if every < 1:
        raise ConfigError(f"checkpoint.every_steps={every} must be >= 1")
    halt_on_nonfinite = train_cfg.get("halt_on_nonfinite", True)
    if not isinstance(halt_on_nonfinite, bool):
        raise ConfigError(f"train.halt_on_nonfinite={halt_on_nonfinite!r} must be True or False")
    num_devices = mesh.devices.size
    batch_size = int(train_cfg.batch_size)
    accum = accumulation_steps(
        batch_size, data_axis_size(mesh), int(train_cfg.get("max_per_device_batch", 0))
    )
    num_steps = int(train_cfg.num_steps)
    until = num_steps if stop_after is None else min(int(stop_after), num_steps)
    eval_every = int(train_cfg.get("eval_every", 0))
    primary = jax.process_index() == 0
    multi_process = jax.process_count() > 1

    output_dir = prepare_output_dir(
        output_dir or str(config.get("output_dir") or "") or os.path.join("runs", config.name)
    )
    if primary:
        with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))

    # This process's rows of every global batch (all rows with one process).
    rows = process_train_rows(batch_size, accum, mesh)
    if not multi_process:
        train_source = task.train_batches
    elif task.process_train_batches is not None:

        def train_source(start: int) -> Iterator[Batch]:
            return task.process_train_batches(start, rows)
    else:

        def train_source(start: int) -> Iterator[Batch]:
            for batch in task.train_batches(start):
                yield {k: np.asarray(v)[rows] for k, v in batch.items()}

    model = build_model(config.model, task.head)
    first = next(train_source(0))
    fresh = create_train_state(config, model, task, first)
    shardings = state_sharding(fresh, mesh)  # per-head attention parameters over "heads"
    fresh = _put_global(fresh, shardings)
    checkpoints = RunCheckpoints(
        os.path.join(output_dir, "checkpoints"), int(ckpt_cfg.get("max_to_keep", 2))
    )
    meta: dict[str, Any] = {"best": None, "best_step": None, "wall_time_s": 0.0}
    restored = checkpoints.restore_latest(fresh)
    resumed_from = None
    state = fresh
    if restored is not None:
        state, meta = restored
        state = _put_global(state, shardings)
        resumed_from = int(state.step)
        saved_index, saved_batch = meta.get("data_index"), meta.get("batch_size")
        if saved_index is not None and int(saved_index) != resumed_from:
            raise ConfigError(
                f"the checkpoint of step {resumed_from} in {checkpoints.directory} records "
                f"data_index={saved_index}; the data position and the state disagree"
            )
        if saved_batch is not None and int(saved_batch) != batch_size:
            raise ConfigError(
                f"train.batch_size={batch_size} differs from the checkpoint's "
                f"{saved_batch} ({checkpoints.directory}): resuming would change the data "
                "order; use the original batch size or a new output_dir"
            )
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
        halt_on_nonfinite,
    )
    eval_rng = jax.random.PRNGKey(int(config.seed) + 1)
    writer: Any = MetricsWriter(output_dir) if primary else _NullWriter()
    progress: Any = ProgressBar(num_steps, stream=progress_stream) if primary else _NullProgress()
    log_every = int(train_cfg.log_every)
    t0 = time.perf_counter()
    wall_before = float(meta.get("wall_time_s") or 0.0)
    pending: list[tuple[int, Any]] = []
    first_done: tuple[int, float] | None = None
    last_train: dict[str, Any] = {}
    halted = _put_global(np.asarray(False), replicated(mesh)) if halt_on_nonfinite else None

    def meta_now() -> dict[str, Any]:
        # The data iterator's state is the step: batch s is train_batches(s)'s first.
        return {
            **meta,
            "wall_time_s": wall_before + time.perf_counter() - t0,
            "data_index": int(state.step),
            "batch_size": batch_size,
        }

    def flush() -> None:
        nonlocal first_done, last_train
        if not pending:
            return
        values, is_halted = jax.device_get(([m for _, m in pending], halted))
        bad = None
        for (step, _), m in zip(pending, values, strict=True):
            rec = {"step": step, "split": "train", "time_s": time.perf_counter() - t0}
            rec.update(_scalars(to_python(m)))
            finite = rec.pop("finite", True)
            if is_halted and not finite:
                rec["nonfinite"] = True
                bad = rec
            writer.write(rec)
            last_train = rec
            if bad is not None:
                break  # later steps ran on the frozen state: not logged
        writer.flush()
        if first_done is None:
            first_done = (pending[0][0], time.perf_counter())
        progress.update(last_train["step"], last_train, force=last_train["step"] == until)
        pending.clear()
        if is_halted:
            if bad is None:  # cannot happen: the flag is set by a step in this flush
                raise RuntimeError("the halted flag is set but no pending step is non-finite")
            host_batch = next(train_source(int(bad["step"]) - 1))
            raise _dump_nonfinite(output_dir, bad, state, host_batch, rows, accum, batch_size)

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

    batches = train_source(start)
    try:
        with StopSignals() as signals:
            for step in range(start, until):
                batch = _put_micro_batch(split_micro_batches(next(batches), accum), mesh)
                if halted is None:
                    state, metrics = train_step(state, batch)
                else:
                    state, metrics, halted = train_step(state, batch, halted)
                done = step + 1
                pending.append((done, metrics))
                boundary = done % log_every == 0 or done == until
                if first_done is None or boundary:
                    flush()
                evaluated = (eval_every and done % eval_every == 0) or done == num_steps
                if evaluated:
                    flush()
                    run_dev(done)
                if evaluated or done % every == 0 or done == until:
                    flush()  # never checkpoint a state that a bad step froze
                    checkpoints.save_latest(state, meta_now())
                # One process checks its flag every step; several agree at log boundaries.
                stop = (
                    _any_process(signals.received is not None)
                    if multi_process and boundary
                    else (not multi_process and signals.received is not None)
                )
                if stop and done < until:
                    flush()
                    checkpoints.save_latest(state, meta_now())
                    return {
                        "stopped_at": done,
                        "output_dir": output_dir,
                        "reason": signals.received or "signal in another process",
                    }
            flush()
        loop_end = time.perf_counter()
        if until < num_steps:
            return {"stopped_at": until, "output_dir": output_dir, "reason": "stop_after"}

        # Test evaluation at the best dev checkpoint (the last state if none).
        best = checkpoints.restore_best(fresh)
        test_state, test_step_no = state, int(state.step)
        if best is not None:
            test_state = _put_global(best[0], shardings)
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
        "processes": jax.process_count(),
        "accumulation_steps": accum,
        "output_dir": output_dir,
        "config": json.loads(config.to_json_best_effort()),
    }
    if primary:
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
        reason = f" ({summary['reason']})" if summary.get("reason") else ""
        return f"stopped at step {summary['stopped_at']}{reason} -> {summary['output_dir']}"
    return (
        f"{summary['task']} ({summary['attention']}, seed {summary['seed']}): "
        f"test accuracy {num(summary['test_accuracy'])} density "
        f"{num(summary['test_density'])} at step {summary['test_step']} | best dev "
        f"{num(summary['best_dev'])} | {summary['steps']} steps in "
        f"{summary['wall_time_s']:.1f} s -> {summary['output_dir']}"
    )
