"""Restore or initialise: where a session of a run starts.

``restore_or_init`` restores the newest readable latest checkpoint of the run (after
checking that it continues this config's data order) or builds a fresh state, from
``config.init_from``'s parameters when it names a run or checkpoint. ``cut_back`` then
makes the run's folder agree with that state: a best checkpoint newer than it is
dropped (or a best lost between two saves is saved again), a finished run's
summary.json goes when it trains further, and the records after the restored step are
cut (``run_dir.truncate_records``); a new run's ``config.json`` is written.

Resume: the training order is random access by step (``train_batches(s)`` starts at the
batch of step ``s``), so the checkpointed step *is* the data iterator's state.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from sbm_jax.training.checkpoints import (
    RunCheckpoints,
    abstract_state,
    check_same_tree,
    load_params,
    short_error,
)
from sbm_jax.training.context import Log, RunContext, RunSettings
from sbm_jax.training.errors import ConfigError
from sbm_jax.training.host_data import process_train_rows, put_global, train_source
from sbm_jax.training.run_dir import CONFIG_FILE, truncate_records, write_atomically
from sbm_jax.training.sharding import state_sharding
from sbm_jax.training.state import (
    ScheduleArgs,
    TrainState,
    create_train_state,
    learning_rate_schedule,
)
from sbm_jax.training.task import Batch, build_task_model


@dataclasses.dataclass
class RunStart:
    """Where a session starts.

    Attributes:
      state: the restored (or fresh) state, on the mesh.
      meta: its checkpoint meta (best so far, wall time, ...).
      resumed_from: the restored step, None for a new run.
      target: what a checkpoint restores into (shapes, dtypes, shardings only).
      shardings: the state's shardings.
      rows, source: this process's rows of every batch; ``start step -> batches``.
    """

    state: TrainState
    meta: dict[str, Any]
    resumed_from: int | None
    target: TrainState
    shardings: Any
    rows: np.ndarray
    source: Callable[[int], Iterator[Batch]]


def dev_step(meta: Mapping[str, Any], step: int | None) -> int | None:
    """The step of the last dev evaluation recorded with a restored checkpoint of
    ``step``: its meta's ``dev_step``; for checkpoints saved before it was kept, inferred
    from the loop's rule under the saved config (evaluate at multiples of
    ``train.eval_every`` and at ``train.num_steps``)."""
    if step is None:
        return None
    if "dev_step" in meta:
        return meta["dev_step"]
    train = (meta.get("config") or {}).get("train") or {}
    every, total = int(train.get("eval_every") or 0), train.get("num_steps")
    if (every and step % every == 0) or step == total:
        return step
    return None


def note_schedule_change(meta: Mapping[str, Any], config: Any, step: int, log: Log) -> None:
    """Say so when a resumed run's learning-rate schedule differs from the one its
    checkpoint was trained with, at the resume step.

    The old schedule is rebuilt from the saved resolved ``train`` section (the
    checkpoint meta's ``config``) as a whole: a task may derive fields from
    ``num_steps`` (GLUE's ``warmup_steps = warmup_fraction x num_steps``), so extending
    a run can change the warm-up too. A field the saved config lacks takes the current
    value. A constant rate does not change, and no note is printed."""
    saved_train = (meta.get("config") or {}).get("train") or {}
    if saved_train.get("num_steps") is None:
        return
    train = config.train
    old_fields = {name: saved_train.get(name, train.get(name)) for name in ScheduleArgs._fields}
    old = float(learning_rate_schedule(**old_fields)(step))
    new = float(learning_rate_schedule(*ScheduleArgs.of(train))(step))
    if old != new:
        named = ("num_steps", "warmup_steps", "learning_rate", "end_learning_rate_factor")
        changed = ", ".join(
            f"train.{name} {old_fields[name]} -> {train.get(name)}"
            for name in named  # the run's length first: what a resume usually changes
            if old_fields[name] != train.get(name)
        )
        log(
            f"note: {changed}: the learning-rate schedule is rebuilt for "
            f"{train.num_steps} steps (rate at step {step}: {old:.3g} -> {new:.3g})"
        )


def _check_restored(
    meta: Mapping[str, Any], step: int, settings: RunSettings, where: str, output_dir: str
) -> None:
    """Refuse a restored checkpoint that this config cannot continue: beyond
    ``train.num_steps``, at a data position other than its step, or from another batch
    size (which would change the data order)."""
    if step > settings.num_steps:
        raise ConfigError(
            f"train.num_steps={settings.num_steps} is below step {step}, where the run in "
            f"{output_dir} stands; raise it (or train into a new output_dir)"
        )
    saved_index, saved_batch = meta.get("data_index"), meta.get("batch_size")
    if saved_index is not None and int(saved_index) != step:
        raise ConfigError(
            f"the checkpoint of step {step} in {where} records "
            f"data_index={saved_index}; the data position and the state disagree"
        )
    if saved_batch is not None and int(saved_batch) != settings.batch_size:
        raise ConfigError(
            f"config.train.batch_size={settings.batch_size} differs from the checkpoint's "
            f"{saved_batch} ({where}): resuming would change the data "
            "order; use the original batch size or a new output_dir"
        )


def restore_or_init(
    run: RunContext, checkpoints: RunCheckpoints, resuming: bool, init_checkpoint: str | None
) -> RunStart:
    """Restore the run's newest readable latest checkpoint, or start a fresh state
    (from ``init_checkpoint``'s parameters when given), saying which.

    Raises:
      ConfigError: a checkpoint this config cannot continue (``_check_restored``).
      CheckpointError: checkpoints exist but none is readable.
    """
    config, task, mesh, settings = run.config, run.task, run.mesh, run.settings
    output_dir, log = run.output_dir, run.log
    rows = process_train_rows(settings.batch_size, settings.accum, mesh)
    source = train_source(task, rows)
    model = build_task_model(task, config.model)
    fresh = create_train_state(config, model, task, next(source(0)))
    shardings = state_sharding(fresh, mesh)  # per-head attention parameters over "heads"
    # What the checkpoints restore into: shapes, dtypes and shardings only. A placed fresh
    # state kept as the target would hold a second copy of the parameters and the Adam
    # moments on the devices for the whole run (until the best restore at the end).
    target = abstract_state(fresh, shardings)

    def unreadable(step: int, moved_to: str, error: Exception) -> None:
        log(
            f"warning: checkpoint {step} in {checkpoints.directory}/latest is unreadable "
            f"({short_error(error)}); moved to {moved_to}, resuming from an older one"
        )

    restored = checkpoints.restore_latest(target, on_unreadable=unreadable)
    meta: dict[str, Any]
    if restored is not None:
        state, meta = restored
        state = put_global(state, shardings)
        step = int(state.step)
        _check_restored(meta, step, settings, checkpoints.directory, output_dir)
        log(f"resuming from step {step} ({output_dir})")
        meta["dev_step"] = dev_step(meta, step)
        note_schedule_change(meta, config, step, log)
        saved_accum = meta.get("accumulation_steps")
        if saved_accum is not None and int(saved_accum) != settings.accum:
            log(
                f"note: gradient accumulation {saved_accum} -> {settings.accum} passes per "
                "step (train.max_per_device_batch, mesh.data): each micro-batch draws its "
                "dropout masks and SBM graphs from its own key, so the random draws from "
                "here differ from an uninterrupted run's (the same in distribution)"
            )
        return RunStart(state, meta, step, target, shardings, rows, source)
    log(
        f"new run in {output_dir}"
        if not resuming
        else f"no checkpoint in {output_dir}: starting at step 0 (its records are replaced)"
    )
    meta = {"best": None, "best_step": None, "wall_time_s": 0.0}
    if init_checkpoint is not None:
        loaded = load_params(init_checkpoint)
        params = (
            task.init_params(fresh.params, loaded)
            if task.init_params is not None
            else check_same_tree(fresh.params, loaded)
        )
        fresh = fresh.replace(params=params)
        log(f"initialised from {init_checkpoint}")
        # Kept with every checkpoint: init_from names a run whose best checkpoint may
        # change before this run resumes; the summary names the one used.
        meta["init_checkpoint"] = init_checkpoint
    return RunStart(put_global(fresh, shardings), meta, None, target, shardings, rows, source)


def cut_back(
    run: RunContext, start: RunStart, checkpoints: RunCheckpoints, run_config: Any, resuming: bool
) -> list[dict[str, Any]]:
    """Make the run's folder agree with ``start`` (see the module docstring; a new
    run's ``config.json`` is ``run_config``); returns the records kept from earlier
    sessions (process 0 of a resumed run; else [])."""
    task, output_dir, log = run.task, run.output_dir, run.log
    step = start.resumed_from or 0
    # A best checkpoint newer than the restored state is from a session whose later
    # checkpoints were lost: the steps after it run again and choose their own best.
    dropped = checkpoints.drop_best_after(step)
    if dropped is not None:
        log(f"dropped the best checkpoint of step {dropped}, after the restored step")
    if (
        start.resumed_from is not None
        and start.meta.get("best_step") == start.resumed_from
        and checkpoints.best_step() != start.resumed_from
    ):
        # Killed between the latest and the best save of an evaluation step.
        checkpoints.save_best(start.state, start.meta)
    if not run.primary:
        return []
    # A summary of a finished run that is now trained further goes first (a stop in
    # between must not leave it describing cut records), then the records after the
    # restored step (all of them without a checkpoint).
    summary_path = os.path.join(output_dir, "summary.json")
    if step < run.settings.num_steps and os.path.isfile(summary_path):
        os.remove(summary_path)
    truncate_records(output_dir, step)
    if not resuming:
        write_atomically(
            os.path.join(output_dir, CONFIG_FILE),
            run_config.to_json_best_effort(indent=2, sort_keys=True),
        )
    if task.save_files is not None:
        task.save_files(output_dir)
    return _read_records(output_dir) if start.resumed_from else []


def _read_records(output_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
