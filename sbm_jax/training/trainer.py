"""The trainer: one loop for every task.

``train_and_evaluate(config, task)`` trains with sharded steps (gradient accumulation,
non-finite guard), evaluates the dev split every ``train.eval_every`` steps and at the
end, keeps the latest and best-dev orbax checkpoints, resumes from the latest one, stops
cleanly on SIGTERM / Ctrl-C, evaluates the test split(s) once at the best checkpoint,
writes test-split predictions when the task asks, and records everything:
``config.json`` (the config as given), ``metrics.jsonl`` (one record per train step,
plus ``split`` "dev" / "test" records), ``metrics.csv``, ``metrics.png``, TensorBoard
event files in ``tensorboard/``, ``checkpoints/{latest,best}/<step>/`` and
``summary.json`` (what was trained: the resolved config, steps, where it resumed; and
what it scored). Each concern lives in a module of its own:

================  ==============================================================
``steps``         the jitted train / eval / predict steps
``host_data``     accumulation layout, this process's rows, global arrays
``checkpoints``   latest/best checkpoints, snapshots, ``config.init_from``
``preemption``    SIGTERM / SIGINT -> checkpoint and return
``nonfinite``     the halt on a NaN/inf step and its replay
``run_dir``       where the run lives, whether it may resume, records cut back
``evaluation``    host loops over an evaluation split
``summary``       summary.json and the one-line summary
================  ==============================================================

Config fields read: ``seed``, ``name``, ``output_dir``, ``init_from``, ``model``,
``train.{batch_size, num_steps, learning_rate, warmup_steps, end_learning_rate_factor,
weight_decay, weight_decay_mask, b1, b2, eps, grad_clip_norm, density_lambda, log_every,
eval_every, max_per_device_batch, halt_on_nonfinite}`` (``weight_decay_mask`` optional,
default "all"), ``checkpoint.{every_steps, max_to_keep,
best_metric, best_mode}`` and ``mesh.{data, heads}`` (the optional ones default to
1000, 2, "accuracy", "max", -1, 1).

Resume: the training order is random access by step (``train_batches(s)`` starts at the
batch of step ``s``), so the checkpointed step *is* the data iterator's state. Running
again into a directory that holds a run resumes it, if the config equals the saved one
but for ``run_dir.SAFE_TO_CHANGE`` fields (else ``ConfigError`` before anything is
written); its records after the restored step are cut away first.

Mesh and sharding: ``("data", "heads")`` of shape ``(mesh.data, mesh.heads)``; batches
split over ``data``, per-head attention parameters (and their Adam moments) over
``heads`` (``sbm_jax.training.sharding``). Multi-process: each process reads only its
rows (``host_data``); only process 0 writes the run's files and prints; every process
takes part in the orbax saves and restores.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, TextIO

import jax
import numpy as np
from jax.sharding import Mesh

from sbm_jax.training.checkpoints import (
    RunCheckpoints,
    abstract_state,
    check_same_tree,
    find_checkpoint,
    load_params,
    short_error,
)
from sbm_jax.training.config_checks import ConfigError, validate_config
from sbm_jax.training.evaluation import evaluate_split, predict_split
from sbm_jax.training.host_data import (
    accumulation_steps,
    process_train_rows,
    put_global,
    put_micro_batch,
    split_micro_batches,
    train_source,
)
from sbm_jax.training.metrics import MetricsWriter, ProgressBar, to_python
from sbm_jax.training.nonfinite import NonFiniteError, dump_nonfinite, replay_nonfinite
from sbm_jax.training.plots import plot_metrics
from sbm_jax.training.preemption import StopSignals, any_process
from sbm_jax.training.run_dir import (
    CONFIG_FILE,
    RunLock,
    check_resume,
    config_as_json,
    prepare_output_dir,
    resolve_output_dir,
    truncate_records,
    write_atomically,
)
from sbm_jax.training.sharding import (
    data_axis_size,
    heads_axis_size,
    mesh_from_config,
    state_sharding,
)
from sbm_jax.training.state import create_train_state, learning_rate_schedule
from sbm_jax.training.steps import (
    make_accumulating_train_step,
    make_detailed_eval_step,
    make_predict_step,
    replicated,
)
from sbm_jax.training.summary import scalars, to_python_json
from sbm_jax.training.task import Task, build_task_model

__all__ = ["NonFiniteError", "replay_nonfinite", "run_training", "train_and_evaluate"]


@functools.lru_cache(maxsize=8)
def _compiled_steps(
    task: Task,
    mesh: Mesh,
    density_lambda: float,
    accum: int,
    schedule_args: tuple[float, int, int, float],
    guard_nonfinite: bool = False,
) -> tuple[Any, Any, Any]:
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
    predict = make_predict_step(task, mesh) if task.predict_splits else None
    return train_step, make_detailed_eval_step(task, mesh), predict


#: The ``train`` fields the learning-rate schedule is built from.
_SCHEDULE_FIELDS = ("num_steps", "warmup_steps", "learning_rate", "end_learning_rate_factor")


def _note_schedule_change(
    meta: Mapping[str, Any], config: Any, step: int, log: Callable[[str], None]
) -> None:
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
    old_fields = {name: saved_train.get(name, train.get(name)) for name in _SCHEDULE_FIELDS}
    old = float(learning_rate_schedule(SimpleNamespace(**old_fields))(step))
    new = float(learning_rate_schedule(train)(step))
    if old != new:
        changed = ", ".join(
            f"train.{name} {old_fields[name]} -> {train.get(name)}"
            for name in _SCHEDULE_FIELDS
            if old_fields[name] != train.get(name)
        )
        log(
            f"note: {changed}: the learning-rate schedule is rebuilt for "
            f"{train.num_steps} steps (rate at step {step}: {old:.3g} -> {new:.3g})"
        )


def _dev_step(meta: Mapping[str, Any], step: int | None) -> int | None:
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


def _no_dev_split_note(task: Task, train_cfg: Any, ckpt_cfg: Any) -> str | None:
    """The note for a task without a dev split whose config asks for dev evaluations
    (``train.eval_every > 0``) or sets the best-checkpoint choice
    (``checkpoint.best_metric`` / ``best_mode`` other than "accuracy" / "max"): those
    fields do nothing there. None when there is a dev split or nothing is asked."""
    if task.eval_batches is not None:
        return None
    ignored = []
    eval_every = int(train_cfg.get("eval_every", 0))
    if eval_every > 0:
        ignored.append(f"train.eval_every={eval_every}")
    for field, default in (("best_metric", "accuracy"), ("best_mode", "max")):
        value = str(ckpt_cfg.get(field, default))
        if value != default:
            ignored.append(f"checkpoint.{field}={value!r}")
    if not ignored:
        return None
    test = (
        "the test split is evaluated at the last state"
        if task.test_splits
        else "there is no test split either, so summary.json's test_accuracy is None"
    )
    return (
        f"note: the task has no dev split, so {', '.join(ignored)} "
        f"{'is' if len(ignored) == 1 else 'are'} ignored: no dev evaluation and no best "
        f"checkpoint; {test}"
    )


def _better(value: float, best: float | None, mode: str) -> bool:
    """Whether dev metric ``value`` beats ``best`` (None: nothing yet) under ``mode``.

    A non-finite value (NaN, inf: a diverged evaluation) is never better, and any finite
    value beats a non-finite best (a best of NaN, saved by a run before this rule, would
    otherwise refuse every later checkpoint: every comparison with NaN is False)."""
    if not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    return value > best if mode == "max" else value < best


class _NullWriter:
    """Metrics sink of the non-primary processes."""

    csv_path = ""

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


def _read_records(output_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class _Overflow:
    """Counts SBM's overflowing graphs (draws above the largest capacity bucket) and
    warns once per session, naming the layer and step. A resumed run whose total is
    already above 0 says so first, so that its own log tells the whole story."""

    def __init__(self, total: float, log: Callable[[str], None]) -> None:
        self.total = float(total)
        self.warned = False
        self._log = log
        if self.total > 0:
            log(
                f"note: {self.total:g} SBM graphs overflowed the largest capacity bucket "
                "before this resume (summary.json's overflow_total goes on counting)"
            )

    def add(self, where: str, step: int, per_layer: Mapping[str, float] | None) -> None:
        if not per_layer:
            return
        count = float(sum(per_layer.values()))
        self.total += count
        if count > 0 and not self.warned:
            self.warned = True
            layers = ", ".join(f"{k} ({v:g})" for k, v in per_layer.items() if v > 0)
            self._log(
                f"warning: SBM graph draws exceeded the largest capacity bucket at {where} "
                f"step {step} in {layers}: edges beyond the bucket were dropped; raise "
                "model.attention_options.max_dense_elements (the dense path takes such "
                "draws; no limit by default), or max_edge_slots with capacity_buckets "
                "(summary.json counts every such graph as overflow_total)"
            )


def train_and_evaluate(
    config: Any,
    task: Task,
    output_dir: str | None = None,
    progress_stream: TextIO | None = None,
    stop_after: int | None = None,
    run_config: Any = None,
    log_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Train ``config`` on ``task`` with dev evaluation, checkpoints and a test evaluation.

    Args:
      config: the full config (``seed``, ``model``, ``train``, optional ``checkpoint``,
        ``mesh``, ``init_from``), as the task resolved it.
      task: the task; its ``eval_batches`` are the dev split.
      output_dir: the run's directory (default ``config.output_dir`` or
        ``runs/<config.name>-<timestamp>``); a run there is resumed.
      progress_stream: where the progress bar goes (default stderr).
      stop_after: stop once ``state.step`` reaches this (simulates an interruption;
        the latest checkpoint is saved, no test evaluation, no summary). None: run to
        ``train.num_steps``.
      run_config: the config as the user gave it, before the task derived fields from
        its data (saved as config.json and compared on resume); default ``config``.
      log_stream: where "resuming from step N" and warnings go (default stdout).

    Returns:
      The summary (also written to summary.json), or, when stopped early,
      ``{"stopped_at": step, "output_dir": ..., "reason": ...}`` with reason
      ``"stop_after"``, ``"SIGTERM"``, ``"SIGINT"`` or ``"SIGHUP"`` (the latest checkpoint holds
      ``step``; running again resumes).

    Raises:
      NonFiniteError: a non-finite loss or gradient (``train.halt_on_nonfinite``).
      ConfigError: a bad config field, a run in ``output_dir`` with another config, or
        one still training there (``run_dir.RunLock``).
    """
    locks: list[RunLock] = []
    try:
        return _train_and_evaluate(
            config, task, output_dir, progress_stream, stop_after, run_config, log_stream, locks
        )
    finally:
        for lock in locks:
            lock.release()


def _train_and_evaluate(
    config: Any,
    task: Task,
    output_dir: str | None,
    progress_stream: TextIO | None,
    stop_after: int | None,
    run_config: Any,
    log_stream: TextIO | None,
    locks: list[RunLock],
) -> dict[str, Any]:
    # train_and_evaluate's body; the run folder's lock goes into ``locks``, which the
    # caller releases however this returns.
    mesh = mesh_from_config(config)
    validate_config(config, head=task.head, device_count=data_axis_size(mesh))
    run_config = config if run_config is None else run_config
    train_cfg = config.train
    ckpt_cfg = config.get("checkpoint") or {}
    best_metric = str(ckpt_cfg.get("best_metric", "accuracy"))
    best_mode = str(ckpt_cfg.get("best_mode", "max"))
    every = int(ckpt_cfg.get("every_steps", 1000))
    halt_on_nonfinite = bool(train_cfg.get("halt_on_nonfinite", True))
    batch_size = int(train_cfg.batch_size)
    accum = accumulation_steps(
        batch_size, data_axis_size(mesh), int(train_cfg.get("max_per_device_batch", 0))
    )
    num_steps = int(train_cfg.num_steps)
    until = num_steps if stop_after is None else min(int(stop_after), num_steps)
    eval_every = int(train_cfg.get("eval_every", 0))
    primary = jax.process_index() == 0
    multi_process = jax.process_count() > 1
    out = log_stream if log_stream is not None else sys.stdout

    def log(message: str) -> None:
        if primary:
            out.write(message + "\n")
            out.flush()

    if jax.device_count() > 1:
        used = int(np.prod(mesh.devices.shape))
        idle = f" ({jax.device_count() - used} idle)" if used < jax.device_count() else ""
        log(
            f"mesh: data={data_axis_size(mesh)} x heads={heads_axis_size(mesh)} on {used} of "
            f"{jax.device_count()} devices{idle}"
        )
    output_dir = resolve_output_dir(config, output_dir)
    existing = check_resume(output_dir, run_config)  # raises before anything is written
    init_checkpoint = find_checkpoint(str(config.init_from)) if config.get("init_from") else None
    output_dir = prepare_output_dir(output_dir)
    if primary:  # before anything in the folder is read or changed
        locks.append(RunLock(output_dir))

    rows = process_train_rows(batch_size, accum, mesh)
    source = train_source(task, rows)
    model = build_task_model(task, config.model)
    fresh_host = create_train_state(config, model, task, next(source(0)))
    shardings = state_sharding(fresh_host, mesh)  # per-head attention parameters over "heads"
    # What the checkpoints restore into: shapes, dtypes and shardings only. A placed fresh
    # state kept as the target would hold a second copy of the parameters and the Adam
    # moments on the devices for the whole run (until the best restore at the end).
    target = abstract_state(fresh_host, shardings)
    checkpoints = RunCheckpoints(
        os.path.join(output_dir, "checkpoints"), int(ckpt_cfg.get("max_to_keep", 2))
    )
    meta: dict[str, Any] = {"best": None, "best_step": None, "wall_time_s": 0.0}

    def unreadable(step: int, moved_to: str, error: Exception) -> None:
        log(
            f"warning: checkpoint {step} in {checkpoints.directory}/latest is unreadable "
            f"({short_error(error)}); moved to {moved_to}, resuming from an older one"
        )

    restored = checkpoints.restore_latest(target, on_unreadable=unreadable)
    resumed_from = None
    if restored is not None:
        state, meta = restored
        state = put_global(state, shardings)
        resumed_from = int(state.step)
        if resumed_from > num_steps:
            raise ConfigError(
                f"train.num_steps={num_steps} is below step {resumed_from}, where the run in "
                f"{output_dir} stands; raise it (or train into a new output_dir)"
            )
        saved_index, saved_batch = meta.get("data_index"), meta.get("batch_size")
        if saved_index is not None and int(saved_index) != resumed_from:
            raise ConfigError(
                f"the checkpoint of step {resumed_from} in {checkpoints.directory} records "
                f"data_index={saved_index}; the data position and the state disagree"
            )
        if saved_batch is not None and int(saved_batch) != batch_size:
            raise ConfigError(
                f"config.train.batch_size={batch_size} differs from the checkpoint's "
                f"{saved_batch} ({checkpoints.directory}): resuming would change the data "
                "order; use the original batch size or a new output_dir"
            )
        log(f"resuming from step {resumed_from} ({output_dir})")
        meta["dev_step"] = _dev_step(meta, resumed_from)
        _note_schedule_change(meta, config, resumed_from, log)
        saved_accum = meta.get("accumulation_steps")
        if saved_accum is not None and int(saved_accum) != accum:
            log(
                f"note: gradient accumulation {saved_accum} -> {accum} passes per step "
                "(train.max_per_device_batch, mesh.data): each micro-batch draws its "
                "dropout masks and SBM graphs from its own key, so the random draws from "
                "here differ from an uninterrupted run's (the same in distribution)"
            )
    else:
        log(
            f"new run in {output_dir}"
            if not existing
            else f"no checkpoint in {output_dir}: starting at step 0 (its records are replaced)"
        )
        if init_checkpoint is not None:
            loaded = load_params(init_checkpoint)
            params = (
                task.init_params(fresh_host.params, loaded)
                if task.init_params is not None
                else check_same_tree(fresh_host.params, loaded)
            )
            state = put_global(fresh_host.replace(params=params), shardings)
            log(f"initialised from {init_checkpoint}")
            # Kept with every checkpoint: init_from names a run whose best checkpoint may
            # change before this run resumes; the summary names the one used.
            meta["init_checkpoint"] = init_checkpoint
        else:
            state = put_global(fresh_host, shardings)
    del fresh_host
    note = _no_dev_split_note(task, train_cfg, ckpt_cfg)
    if note is not None:
        log(note)
    # A best checkpoint newer than the restored state is from a session whose later
    # checkpoints were lost: the steps after it run again and choose their own best.
    dropped = checkpoints.drop_best_after(resumed_from or 0)
    if dropped is not None:
        log(f"dropped the best checkpoint of step {dropped}, after the restored step")
    if (
        resumed_from is not None
        and meta.get("best_step") == resumed_from
        and checkpoints.best_step() != resumed_from
    ):
        # Killed between the latest and the best save of an evaluation step.
        checkpoints.save_best(state, meta)
    if primary:
        # A summary of a finished run that is now trained further goes first (a stop in
        # between must not leave it describing cut records), then the records after the
        # restored step (all of them without a checkpoint).
        summary_path = os.path.join(output_dir, "summary.json")
        if (resumed_from or 0) < num_steps and os.path.isfile(summary_path):
            os.remove(summary_path)
        truncate_records(output_dir, resumed_from or 0)
        if not existing:
            write_atomically(
                os.path.join(output_dir, CONFIG_FILE),
                run_config.to_json_best_effort(indent=2, sort_keys=True),
            )
        if task.save_files is not None:
            task.save_files(output_dir)
    previous = _read_records(output_dir) if primary and resumed_from else []
    start = int(state.step)

    train_step, eval_step, predict_step = _compiled_steps(
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
    overflow = _Overflow(float(meta.get("overflow_total") or 0.0), log)
    pending: list[tuple[int, Any]] = []
    first_done: tuple[int, float] | None = None
    trained = [r for r in previous if r.get("split", "train") == "train"]
    last_train: dict[str, Any] = trained[-1] if trained else {}
    first_train: dict[str, Any] = trained[0] if trained else {}
    devs = [r for r in previous if r.get("split") == "dev"]
    last_dev: dict[str, Any] = devs[-1] if devs else {}
    halted = put_global(np.asarray(False), replicated(mesh)) if halt_on_nonfinite else None
    resolved = config_as_json(config)

    def meta_now() -> dict[str, Any]:
        # The data iterator's state is the step: batch s is train_batches(s)'s first.
        return {
            **meta,
            "wall_time_s": wall_before + time.perf_counter() - t0,
            "data_index": int(state.step),
            "batch_size": batch_size,
            # Passes per step: micro-batch i draws from fold_in(rng, i), so the number
            # fixes the random draws (dropout, SBM graphs) of every later step.
            "accumulation_steps": accum,
            "overflow_total": overflow.total,
            "config": resolved,
        }

    def flush() -> None:
        nonlocal first_done, last_train, first_train
        if not pending:
            return
        values, is_halted = jax.device_get(([m for _, m in pending], halted))
        bad = None
        for (step, _), m in zip(pending, values, strict=True):
            # Seconds of training in all the run's sessions (as wall_time_s), not this one.
            rec = {"step": step, "split": "train", "time_s": wall_before + time.perf_counter() - t0}
            rec.update(to_python(m))
            rec.pop("weight", None)
            overflow.add("train", step, rec.pop("overflow_per_layer", None))  # type: ignore[arg-type]
            finite = rec.pop("finite", True)
            if is_halted and not finite:
                rec["nonfinite"] = True
                bad = rec
            writer.write(rec)
            last_train = rec
            first_train = first_train or rec
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
            host_batch = next(source(int(bad["step"]) - 1))  # type: ignore[call-overload]
            raise dump_nonfinite(output_dir, bad, state, host_batch, rows, accum, batch_size)

    def evaluation_record(split: str, step: int, result: Mapping[str, Any]) -> dict[str, Any]:
        overflow.add(split, step, result.get("overflow_per_layer"))
        return {"step": step, "split": split, **scalars(result)}

    def run_dev(step: int) -> bool:
        """Evaluate the dev split; True when it is the best so far (``meta`` updated;
        the caller saves the best checkpoint after the latest one)."""
        nonlocal last_dev
        if task.eval_batches is None:
            return False
        result = evaluate_split(
            eval_step, state, task.eval_batches(), mesh, eval_rng, task.eval_metrics
        )
        last_dev = evaluation_record("dev", step, result)
        writer.write(last_dev)
        writer.flush()
        meta["dev_step"] = step
        if best_metric not in result:
            raise ConfigError(
                f"config.checkpoint.best_metric={best_metric!r} is not a dev metric; "
                f"have {sorted(scalars(result))}"
            )
        if _better(float(result[best_metric]), meta.get("best"), best_mode):
            meta["best"], meta["best_step"] = float(result[best_metric]), step
            return True
        return False

    def plot() -> str | None:
        if not primary or not os.path.isfile(writer.csv_path):
            return None
        name = str(config.get("name", "run"))
        return plot_metrics(
            [writer.csv_path],
            os.path.join(output_dir, "metrics.png"),
            labels=[name],
            title=f"{name} ({config.model.attention})",
        )

    batches = source(start)
    try:
        with StopSignals() as signals:
            for step in range(start, until):
                batch = put_micro_batch(split_micro_batches(next(batches), accum), mesh)
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
                improved = False
                if evaluated:
                    flush()
                    improved = run_dev(done)
                if evaluated or done % every == 0 or done == until:
                    flush()  # never checkpoint a state that a bad step froze
                    checkpoints.save_latest(state, meta_now())
                if improved:
                    # After the latest save: a stop between the two leaves a latest
                    # checkpoint whose meta names this step, and the resume saves the
                    # best from it (a best saved first could outlive its latest).
                    checkpoints.save_best(state, meta_now())
                # One process checks its flag every step; several agree at log boundaries.
                stop = (
                    any_process(signals.received is not None)
                    if multi_process and boundary
                    else (not multi_process and signals.received is not None)
                )
                if stop and done < until:
                    flush()
                    checkpoints.save_latest(state, meta_now())
                    writer.flush()
                    plot()
                    return {
                        "stopped_at": done,
                        "output_dir": output_dir,
                        "reason": signals.received or "signal in another process",
                    }
            flush()
        loop_end = time.perf_counter()
        if until < num_steps:
            writer.flush()
            plot()
            return {"stopped_at": until, "output_dir": output_dir, "reason": "stop_after"}
        if task.eval_batches is not None and meta.get("dev_step") != num_steps:
            # Resumed at exactly train.num_steps (a run stopped there, then shrunk to
            # it): the loop ran no step, so the final state was never evaluated nor a
            # candidate for the best. Its latest checkpoint exists: its meta is updated,
            # so a later resume does not evaluate it again.
            improved = run_dev(num_steps)
            checkpoints.update_latest_meta(num_steps, meta_now())
            if improved:
                checkpoints.save_best(state, meta_now())

        # Test evaluation at the best dev checkpoint (the last state if none).

        def best_unreadable(step: int, moved_to: str, error: Exception) -> None:
            log(
                f"warning: the best checkpoint (step {step}) is unreadable "
                f"({short_error(error)}); moved to {moved_to}, testing the last state"
            )

        best = checkpoints.restore_best(target, on_unreadable=best_unreadable)
        test_state, test_step_no = state, int(state.step)
        if best is not None:
            test_state = put_global(best[0], shardings)
            test_step_no = int(test_state.step)
        splits = dict(task.test_splits or {})
        if not splits and task.eval_batches is not None:
            splits = {"dev": task.eval_batches}
        tests: dict[str, dict[str, Any]] = {}
        for i, (name, batches_fn) in enumerate(splits.items()):
            result = evaluate_split(
                eval_step, test_state, batches_fn(), mesh, eval_rng, task.eval_metrics
            )
            tests[name] = result
            split = "test" if i == 0 else f"test_{name}"
            writer.write({**evaluation_record(split, test_step_no, result), "dataset": name})
        predictions: dict[str, str] = {}
        if task.predict_splits and predict_step is not None:
            for name, batches_fn in task.predict_splits.items():
                index, predicted = predict_split(
                    predict_step, test_state, batches_fn(), mesh, eval_rng
                )
                if primary and task.write_predictions is not None:
                    predictions[name] = task.write_predictions(name, index, predicted, output_dir)
        writer.flush()
    finally:
        progress.close()
        writer.close()
        checkpoints.close()
    plot_path = plot()

    steps_run = until - start
    rate = math.nan
    if first_done is not None and until - first_done[0] > 0:
        rate = (until - first_done[0]) / max(loop_end - first_done[1], 1e-9)
    test = next(iter(tests.values()), {})
    summary: dict[str, Any] = {
        "name": str(config.get("name", "run")),
        "task": str(config.task.name),
        "attention": str(config.model.attention),
        "seed": int(config.seed),
        "density_lambda": float(train_cfg.density_lambda),
        "steps": int(state.step),
        "steps_this_session": steps_run,
        "resumed_from": resumed_from,
        "init_from": meta.get("init_checkpoint", init_checkpoint),
        "step": last_train.get("step"),
        "loss": last_train.get("loss"),
        "accuracy": last_train.get("accuracy"),
        "density": last_train.get("density"),
        "density_per_head": last_train.get("density_per_head"),
        "first_loss": first_train.get("loss"),
        "final_train": scalars(last_train),
        "eval": scalars(last_dev) or None,
        "test_step": test_step_no,
        "test_split": next(iter(tests), None),
        "test_accuracy": test.get("accuracy"),
        "test_loss": test.get("loss"),
        "test_density": test.get("density"),
        "test_density_per_head": test.get("density_per_head"),
        "test_examples": test.get("examples"),
        "test_splits": tests,
        "best_dev": meta.get("best"),
        "best_dev_metric": best_metric,
        "best_dev_step": meta.get("best_step"),
        "overflow_total": overflow.total,
        "predictions": predictions,
        "wall_time_s": wall_before + (time.perf_counter() - t0),
        "steps_per_s": rate,
        "examples_per_s": rate * batch_size if math.isfinite(rate) else rate,
        "devices": int(mesh.devices.size),
        "processes": jax.process_count(),
        "accumulation_steps": accum,
        "output_dir": output_dir,
        "plot": plot_path,
        "config": resolved,
    }
    if task.summarize is not None:
        summary.update(task.summarize(summary))
    if primary:
        write_atomically(
            os.path.join(output_dir, "summary.json"),
            json.dumps(to_python_json(summary), indent=2, sort_keys=True),
        )
    return summary


def compiled_step_estimate(config: Any, task: Task) -> dict[str, float]:
    """XLA's estimate for one training step of ``config`` on ``task``, from the step
    compiled on abstract state (nothing trained, nothing written): ``memory_bytes``
    (arguments + outputs - donated aliases + temporaries, per device), ``flops`` (0 when
    the backend does not say) and ``device_bytes`` (the device's memory, 0 when unknown;
    the host's on CPU)."""
    mesh = mesh_from_config(config)
    train_cfg = config.train
    batch_size = int(train_cfg.batch_size)
    accum = accumulation_steps(
        batch_size, data_axis_size(mesh), int(train_cfg.get("max_per_device_batch", 0))
    )
    halt = bool(train_cfg.get("halt_on_nonfinite", True))
    rows = process_train_rows(batch_size, accum, mesh)
    host_batch = next(train_source(task, rows)(0))
    model = build_task_model(task, config.model)
    fresh = create_train_state(config, model, task, host_batch)
    target = abstract_state(fresh, state_sharding(fresh, mesh))
    del fresh
    batch = put_micro_batch(split_micro_batches(host_batch, accum), mesh)
    schedule = (
        float(train_cfg.learning_rate),
        int(train_cfg.warmup_steps),
        int(train_cfg.num_steps),
        float(train_cfg.end_learning_rate_factor),
    )
    train_step = _compiled_steps(
        task, mesh, float(train_cfg.density_lambda), accum, schedule, halt
    )[0]
    args = (target, batch) + ((put_global(np.asarray(False), replicated(mesh)),) if halt else ())
    jitted = train_step.jitted(target) if hasattr(train_step, "jitted") else train_step
    compiled = jitted.lower(*args).compile()
    memory = compiled.memory_analysis()
    used = 0.0
    if memory is not None:
        used = float(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    flops = float((cost or {}).get("flops", 0.0)) if isinstance(cost, Mapping) else 0.0
    return {"memory_bytes": used, "flops": max(flops, 0.0), "device_bytes": device_memory()}


def device_memory() -> float:
    """Bytes of memory of one device (its allocator's limit on GPU / TPU), the host's
    physical memory on CPU; 0 when unknown."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        return float(stats.get("bytes_limit", 0))
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def run_training(
    config: Any,
    task: Task,
    output_dir: str | None = None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """``train_and_evaluate`` under the name the notebook and scripts call it by."""
    return train_and_evaluate(config, task, output_dir, progress_stream=progress_stream)
