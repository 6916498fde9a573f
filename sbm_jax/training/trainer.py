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
what it scored). ``train_and_evaluate`` reads as the list of its stages; each lives in
the module of its concern:

================  ==============================================================
``run_dir``       open the run: where it lives, whether it may resume, its lock
``resume``        restore or initialise (``init_from``), records cut back
``steps``         the jitted train / eval / predict steps, compiled once per task
``loop``          the settings read from the config; the loop: host syncs, dev
                  evaluations, checkpoints, signal stops, the non-finite halt
``evaluation``    the test splits and predictions at the best checkpoint
``summary``       summary.json and the one-line summary
================  ==============================================================

Mesh and sharding: ``("data", "heads")`` of shape ``(mesh.data, mesh.heads)``; batches
split over ``data``, per-head attention parameters (and their Adam moments) over
``heads`` (``sbm_jax.training.sharding``). Multi-process: each process reads only its
rows (``host_data``); only process 0 writes the run's files and prints; every process
takes part in the orbax saves and restores.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO, cast

import jax
import numpy as np

from sbm_jax.training.checkpoints import RunCheckpoints, find_checkpoint
from sbm_jax.training.config_checks import validate_config
from sbm_jax.training.context import Log, RunContext, RunSettings
from sbm_jax.training.evaluation import evaluate_at_best
from sbm_jax.training.loop import TrainLoop, no_dev_split_note
from sbm_jax.training.nonfinite import NonFiniteError, replay_nonfinite
from sbm_jax.training.plots import plot_run
from sbm_jax.training.preemption import HangupSafe
from sbm_jax.training.resume import cut_back, restore_or_init
from sbm_jax.training.run_dir import RunFolder, check_run_folder, open_run_folder
from sbm_jax.training.sharding import (
    data_axis_size,
    heads_axis_size,
    mesh_from_config,
)
from sbm_jax.training.steps import compiled_steps
from sbm_jax.training.summary import run_summary, write_summary
from sbm_jax.training.task import Task

__all__ = ["NonFiniteError", "replay_nonfinite", "train_and_evaluate"]


def train_and_evaluate(
    config: Any,
    task: Task,
    output_dir: str | RunFolder | None = None,
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
        ``runs/<config.name>-<timestamp>``); a run there is resumed. A ``RunFolder``
        (``run_dir.check_run_folder``) is a directory the caller has checked with the
        config, as the command line does before it builds the task: then neither the
        folder nor the config is checked again.
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
      ``"stop_after"``, ``"SIGTERM"``, ``"SIGINT"`` or ``"SIGHUP"`` (the latest checkpoint
      holds ``step``; running again resumes).

    Raises:
      NonFiniteError: a non-finite loss or gradient (``train.halt_on_nonfinite``).
      ConfigError: a bad config field, a run in ``output_dir`` with another config, or
        one still training there (``run_dir.RunLock``).
    """
    # --- Open the run: the config and the folder, each checked once --------------------
    run_config = config if run_config is None else run_config
    primary = jax.process_index() == 0
    # Streams that survive a terminal hanging up (a line written before the SIGHUP's
    # handler runs would otherwise crash the run before it saves).
    log = _log(cast(TextIO, HangupSafe(log_stream or sys.stdout)), primary)
    progress_stream = cast(TextIO, HangupSafe(progress_stream or sys.stderr))
    mesh = mesh_from_config(config)
    folder = output_dir
    if not isinstance(folder, RunFolder):
        validate_config(config, head=task.head, device_count=data_axis_size(mesh))
    settings = RunSettings.from_config(config, mesh, stop_after)
    _say_mesh(mesh, log)
    if not isinstance(folder, RunFolder):
        folder = check_run_folder(run_config, folder)  # raises before anything is written
    init_from = find_checkpoint(str(config.init_from)) if config.get("init_from") else None
    with open_run_folder(folder, primary) as out:
        run = RunContext(config, task, mesh, settings, out, primary, log)

        # --- Restore or initialise; the records cut back to the state -------------------
        checkpoints = RunCheckpoints(os.path.join(out, "checkpoints"), settings.max_to_keep)
        start = restore_or_init(run, checkpoints, folder.resuming, init_from)
        note = no_dev_split_note(task, settings)
        if note is not None:
            log(note)
        previous = cut_back(run, start, checkpoints, run_config, folder.resuming)

        # --- Compile the steps ------------------------------------------------------------
        s = settings
        steps = compiled_steps(
            task, mesh, s.density_lambda, s.accum, s.schedule, s.halt_on_nonfinite
        )

        # --- Train: dev evaluations, checkpoints, signal stops; then test at the best ------
        loop = TrainLoop(run, steps, start, checkpoints, previous, progress_stream)
        try:
            stopped = loop.run()
            if stopped is None:
                loop.evaluate_final()
                restore_into = (start.target, start.shardings)
                test_step, tests, predictions = evaluate_at_best(
                    run, checkpoints, loop.state, restore_into, steps, loop.eval_rng
                )
                loop.write_tests(test_step, tests)
        finally:
            loop.close()
            checkpoints.close()
        plot = plot_run(config, out, primary)
        if stopped is not None:
            return stopped

        # --- The summary ------------------------------------------------------------------
        summary = run_summary(
            config,
            loop=loop.summary_fields(),
            resumed_from=start.resumed_from,
            init_from=start.meta.get("init_checkpoint", init_from),
            test_step=test_step,
            tests=tests,
            predictions=predictions,
            devices=int(mesh.devices.size),
            processes=jax.process_count(),
            output_dir=out,
            plot=plot,
            resolved=loop.resolved,
        )
        if task.summarize is not None:
            summary.update(task.summarize(summary))
        if primary:
            write_summary(out, summary)
        return summary


def _log(stream: TextIO, primary: bool) -> Log:
    """``message -> None``: a line on ``stream`` from process 0."""

    def log(message: str) -> None:
        if primary:
            stream.write(message + "\n")
            stream.flush()

    return log


def _say_mesh(mesh: Any, log: Log) -> None:
    """One line on the mesh, when there is more than one device."""
    if jax.device_count() > 1:
        used = int(np.prod(mesh.devices.shape))
        idle = f" ({jax.device_count() - used} idle)" if used < jax.device_count() else ""
        log(
            f"mesh: data={data_axis_size(mesh)} x heads={heads_axis_size(mesh)} on {used} of "
            f"{jax.device_count()} devices{idle}"
        )
