"""Non-finite steps (``train.halt_on_nonfinite``, default True): halt with replay state.

The jitted step checks the loss and the global gradient norm and keeps a device-side
sticky ``halted`` flag; from the first bad step on, updates are skipped (the state stays
the one *before* that step), with no host sync per step. At the next metrics flush the
trainer finds the first bad step ``s`` and writes ``nonfinite/step_<s>/``:
``state/<s-1>/`` (orbax), ``batch.npz`` (the step's batch; one ``batch_process<k>.npz``
per process in multi-process jobs) and ``info.json`` (step, data_index, loss, grad norm,
rng, how to replay), then raises ``NonFiniteError``. ``replay_nonfinite(directory,
config, task)`` recomputes that step.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from sbm_jax.training.checkpoints import restore_snapshot, save_snapshot
from sbm_jax.training.host_data import split_micro_batches
from sbm_jax.training.sharding import make_mesh
from sbm_jax.training.state import TrainState, create_train_state
from sbm_jax.training.steps import make_train_step, micro_batch_sharding, replicated
from sbm_jax.training.task import Task, build_task_model


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


def _json_float(value: Any) -> float | str | None:
    """A float for JSON: finite as is, non-finite as "nan" / "inf" / "-inf"."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _batch_file(process_index: int, process_count: int) -> str:
    return "batch.npz" if process_count == 1 else f"batch_process{process_index}.npz"


def dump_nonfinite(
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
        **{k: np.asarray(v) for k, v in host_batch.items()},  # type: ignore[arg-type]
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
        "replay": "from sbm_jax.training.nonfinite import replay_nonfinite; "
        f"replay_nonfinite({directory!r})",
    }
    if jax.process_index() == 0:
        with open(os.path.join(directory, "info.json"), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, sort_keys=True)
    message = (
        f"non-finite loss or gradient at step {step} (loss={info['loss']}, "
        f"grad_norm={info['grad_norm']}); training stopped with the state before that step. "
        f"Saved for replay in {directory}: state/{step - 1}/ (orbax), "
        f"{batch_file} (the step's batch, data_index {step - 1}), info.json. Replay with "
        f"replay_nonfinite({directory!r}); set train.halt_on_nonfinite=False "
        "to train through such steps."
    )
    return NonFiniteError(message, step, directory)


def replay_nonfinite(
    directory: str, config: Any | None = None, task: Task | None = None
) -> dict[str, Any]:
    """Recompute a step saved by a ``NonFiniteError`` (``nonfinite/step_<s>/``).

    Restores the state from before step ``s``, loads its batch (all processes' rows, put
    back in global order) and runs the same (unguarded) accumulating step, with the same
    rng and micro-batches, on one device.

    Args:
      directory: the dump's directory (``NonFiniteError.directory``), in its run's
        directory as the trainer writes it: ``<run>/nonfinite/step_<s>``.
      config: the run's config (model and train sections as when it failed); default:
        the run's ``config.json``.
      task: the run's task (its loss and model inputs); default: built from ``config``
        as the command line builds it (the task modules imported by name).

    Returns:
      ``{"step", "data_index", "state_step", "loss", "total_loss", "grad_norm",
      "finite"}`` of the replayed step (floats may be nan/inf).
    """
    if config is None or task is None:
        config, task = _run_config_and_task(directory, config)
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
    model = build_task_model(task, config.model)
    fresh = jax.device_put(create_train_state(config, model, task, batch), replicated(mesh))
    state, _ = restore_snapshot(os.path.join(directory, "state"), fresh)
    accum = int(info["accumulation_steps"])
    step_fn = make_train_step(task, mesh, float(config.train.density_lambda), accum_steps=accum)
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


def _run_config_and_task(directory: str, config: Any | None) -> tuple[Any, Task]:
    """The config (``config.json`` of the run holding ``directory`` unless given) and the
    task built from it, as ``scripts/train.py`` builds them."""
    import ml_collections

    from sbm_jax.tasks import build_task
    from sbm_jax.tasks.registry import DEFAULT_TASK_MODULES, import_task_modules
    from sbm_jax.training.run_dir import saved_config

    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(directory)))
    if config is None:
        saved = saved_config(run_dir)
        if saved is None:
            raise FileNotFoundError(
                f"replay_nonfinite: no config.json in {run_dir} (the run holding "
                f"{directory}); pass the run's config and task"
            )
        config = ml_collections.ConfigDict(saved)
    import_task_modules(DEFAULT_TASK_MODULES)  # the tasks register by name
    return config, build_task(config, output_dir=run_dir)
