"""The training loop: steps, host syncs, dev evaluations, checkpoints and signal stops.

``TrainLoop`` runs the steps of one session and keeps their bookkeeping (pending
metrics, the last train and dev records, the overflow count, the checkpoint meta):
every ``train.log_every`` steps it brings the metrics to the host (progress line,
records, the non-finite halt); every ``train.eval_every`` steps and at the end it
evaluates the dev split; it saves the latest checkpoint every ``checkpoint.every_steps``
and at each evaluation, then the best; a SIGTERM, Ctrl-C or SIGHUP saves and stops.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

from sbm_jax.config_defaults import DEFAULTS
from sbm_jax.training import evaluation
from sbm_jax.training.context import Log, RunContext, RunSettings
from sbm_jax.training.errors import ConfigError
from sbm_jax.training.host_data import put_global, put_micro_batch, split_micro_batches
from sbm_jax.training.metrics import (
    MetricsWriter,
    NullProgress,
    NullWriter,
    ProgressBar,
    to_python,
)
from sbm_jax.training.nonfinite import dump_nonfinite
from sbm_jax.training.preemption import StopSignals, any_process
from sbm_jax.training.resume import RunStart
from sbm_jax.training.run_dir import config_as_json
from sbm_jax.training.steps import replicated
from sbm_jax.training.summary import scalars
from sbm_jax.training.task import Task


def better(value: float, best: float | None, mode: str) -> bool:
    """Whether dev metric ``value`` beats ``best`` (None: nothing yet) under ``mode``.

    A non-finite value (NaN, inf: a diverged evaluation) is never better, and any finite
    value beats a non-finite best (a best of NaN, saved by a run before this rule, would
    otherwise refuse every later checkpoint: every comparison with NaN is False)."""
    if not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    return value > best if mode == "max" else value < best


def no_dev_split_note(task: Task, settings: RunSettings) -> str | None:
    """The note for a task without a dev split whose config asks for dev evaluations
    (``train.eval_every > 0``) or sets the best-checkpoint choice
    (``checkpoint.best_metric`` / ``best_mode`` other than their defaults): those
    fields do nothing there. None when there is a dev split or nothing is asked."""
    if task.eval_batches is not None:
        return None
    ignored = []
    if settings.eval_every > 0:
        ignored.append(f"train.eval_every={settings.eval_every}")
    for name, value in (("best_metric", settings.best_metric), ("best_mode", settings.best_mode)):
        if value != DEFAULTS[f"checkpoint.{name}"]:
            ignored.append(f"checkpoint.{name}={value!r}")
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


class Overflow:
    """Counts SBM's overflowing graphs (draws above the largest capacity bucket) and
    warns once per session, naming the layer and step. A resumed run whose total is
    already above 0 says so first, so that its own log tells the whole story."""

    def __init__(self, total: float, log: Log) -> None:
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


class TrainLoop:
    """One session of training from ``start`` (a restored or fresh state) to
    ``settings.until``, with its records (``metrics.jsonl``, ``metrics.csv``,
    TensorBoard) and progress line, both written by process 0 only.

    Args:
      run: the session's context.
      steps: ``(train_step, eval_step, predict_step)`` (``steps.compiled_steps``).
      start: where it starts (``resume.restore_or_init``); its ``meta`` is updated as
        it trains.
      checkpoints: the run's ``RunCheckpoints``.
      previous: the run's earlier records (a resumed run's), for the summary.
      progress_stream: where the progress line goes (default stderr).
    """

    def __init__(
        self,
        run: RunContext,
        steps: tuple[Any, Any, Any],
        start: RunStart,
        checkpoints: Any,
        previous: Sequence[Mapping[str, Any]],
        progress_stream: TextIO | None = None,
    ) -> None:
        self.run_ctx, self.task, self.mesh, self.settings = run, run.task, run.mesh, run.settings
        self.train_step, self.eval_step, self.predict_step = steps
        self.state, self.meta = start.state, start.meta
        self.source, self.rows = start.source, start.rows
        self.checkpoints, self.output_dir = checkpoints, run.output_dir
        self.writer: Any = MetricsWriter(run.output_dir) if run.primary else NullWriter()
        self.progress: Any = (
            ProgressBar(run.settings.num_steps, stream=progress_stream)
            if run.primary
            else NullProgress()
        )
        self.resolved = config_as_json(run.config)
        self.eval_rng = jax.random.PRNGKey(int(run.config.seed) + 1)
        self.start = int(self.state.step)
        self.t0 = time.perf_counter()
        self.wall_before = float(self.meta.get("wall_time_s") or 0.0)
        self.overflow = Overflow(float(self.meta.get("overflow_total") or 0.0), run.log)
        self.pending: list[tuple[int, Any]] = []
        self.first_done: tuple[int, float] | None = None  # (step, time) of the first sync
        self.loop_end = math.nan
        trained = [r for r in previous if r.get("split", "train") == "train"]
        self.last_train: dict[str, Any] = dict(trained[-1]) if trained else {}
        self.first_train: dict[str, Any] = dict(trained[0]) if trained else {}
        devs = [r for r in previous if r.get("split") == "dev"]
        self.last_dev: dict[str, Any] = dict(devs[-1]) if devs else {}
        self.halted = (
            put_global(np.asarray(False), replicated(self.mesh))
            if self.settings.halt_on_nonfinite
            else None
        )

    def close(self) -> None:
        """Close the records and the progress line."""
        self.progress.close()
        self.writer.close()

    def write_tests(self, step: int, tests: Mapping[str, Mapping[str, Any]]) -> None:
        """The test records (``test``, then ``test_<name>`` for further splits)."""
        for i, (name, result) in enumerate(tests.items()):
            split = "test" if i == 0 else f"test_{name}"
            self.writer.write({**self.record(split, step, result), "dataset": name})
        self.writer.flush()

    # --- Bookkeeping ----------------------------------------------------------------

    def wall_time(self) -> float:
        """Seconds of training in all the run's sessions."""
        return self.wall_before + time.perf_counter() - self.t0

    def meta_now(self) -> dict[str, Any]:
        """The checkpoint meta of the current state. The data iterator's state is the
        step: batch ``s`` is ``train_batches(s)``'s first."""
        return {
            **self.meta,
            "wall_time_s": self.wall_time(),
            "data_index": int(self.state.step),
            "batch_size": self.settings.batch_size,
            # Passes per step: micro-batch i draws from fold_in(rng, i), so the number
            # fixes the random draws (dropout, SBM graphs) of every later step.
            "accumulation_steps": self.settings.accum,
            "overflow_total": self.overflow.total,
            "config": self.resolved,
        }

    def steps_per_s(self) -> float:
        """Steps per second from the first host sync to the loop's end (nan: too few)."""
        if self.first_done is None or self.settings.until - self.first_done[0] <= 0:
            return math.nan
        done = self.settings.until - self.first_done[0]
        return done / max(self.loop_end - self.first_done[1], 1e-9)

    def record(self, split: str, step: int, result: Mapping[str, Any]) -> dict[str, Any]:
        """The record of an evaluation of ``split`` at ``step`` (its overflow counted)."""
        self.overflow.add(split, step, result.get("overflow_per_layer"))
        return {"step": step, "split": split, **scalars(result)}

    # --- Host syncs -----------------------------------------------------------------

    def flush(self) -> None:
        """Bring the pending steps' metrics to the host: records, progress line, and the
        halt (with the replay state dumped) when a step was non-finite."""
        if not self.pending:
            return
        values, is_halted = jax.device_get(([m for _, m in self.pending], self.halted))
        bad: dict[str, Any] | None = None
        for (step, _), m in zip(self.pending, values, strict=True):
            # Seconds of training in all the run's sessions (as wall_time_s), not this one.
            rec = {"step": step, "split": "train", "time_s": self.wall_time()}
            rec.update(to_python(m))
            rec.pop("weight", None)
            self.overflow.add("train", step, rec.pop("overflow_per_layer", None))  # type: ignore[arg-type]
            finite = rec.pop("finite", True)
            if is_halted and not finite:
                rec["nonfinite"] = True
                bad = rec
            self.writer.write(rec)
            self.last_train = rec
            self.first_train = self.first_train or rec
            if bad is not None:
                break  # later steps ran on the frozen state: not logged
        self.writer.flush()
        if self.first_done is None:
            self.first_done = (self.pending[0][0], time.perf_counter())
        last = self.last_train["step"]
        self.progress.update(last, self.last_train, force=last == self.settings.until)
        self.pending.clear()
        if is_halted:
            if bad is None:  # cannot happen: the flag is set by a step in this flush
                raise RuntimeError("the halted flag is set but no pending step is non-finite")
            host_batch = next(self.source(int(bad["step"]) - 1))
            s = self.settings
            raise dump_nonfinite(
                self.output_dir, bad, self.state, host_batch, self.rows, s.accum, s.batch_size
            )

    # --- Dev evaluation ---------------------------------------------------------------

    def evaluate_dev(self, step: int) -> bool:
        """Evaluate the dev split; True when it is the best so far (``meta`` updated;
        the caller saves the best checkpoint after the latest one)."""
        if self.task.eval_batches is None:
            return False
        result = evaluation.evaluate_split(
            self.eval_step,
            self.state,
            self.task.eval_batches(),
            self.mesh,
            self.eval_rng,
            self.task.eval_metrics,
        )
        self.last_dev = self.record("dev", step, result)
        self.writer.write(self.last_dev)
        self.writer.flush()
        self.meta["dev_step"] = step
        metric, mode = self.settings.best_metric, self.settings.best_mode
        if metric not in result:
            raise ConfigError(
                f"config.checkpoint.best_metric={metric!r} is not a dev metric; "
                f"have {sorted(scalars(result))}"
            )
        if better(float(result[metric]), self.meta.get("best"), mode):
            self.meta["best"], self.meta["best_step"] = float(result[metric]), step
            return True
        return False

    def evaluate_final(self) -> None:
        """Evaluate the final state on the dev split when the loop did not: a run
        resumed at exactly ``train.num_steps`` (stopped there, then shrunk to it) ran no
        step, so its state was never evaluated nor a candidate for the best. Its latest
        checkpoint exists: its meta is updated, so a later resume does not evaluate it
        again."""
        num_steps = self.settings.num_steps
        if self.task.eval_batches is None or self.meta.get("dev_step") == num_steps:
            return
        improved = self.evaluate_dev(num_steps)
        self.checkpoints.update_latest_meta(num_steps, self.meta_now())
        if improved:
            self.checkpoints.save_best(self.state, self.meta_now())

    # --- The loop ---------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        """Train from the state's step to ``settings.until``. Returns None when the loop
        reached it, else the stop (``stopped_at``, ``output_dir``, ``reason``): a signal,
        after saving the latest checkpoint, or ``stop_after``."""
        s, multi_process = self.settings, jax.process_count() > 1
        batches = self.source(self.start)
        with StopSignals() as signals:
            for step in range(self.start, s.until):
                batch = put_micro_batch(split_micro_batches(next(batches), s.accum), self.mesh)
                if self.halted is None:
                    self.state, metrics = self.train_step(self.state, batch)
                else:
                    self.state, metrics, self.halted = self.train_step(
                        self.state, batch, self.halted
                    )
                done = step + 1
                self.pending.append((done, metrics))
                boundary = done % s.log_every == 0 or done == s.until
                if self.first_done is None or boundary:
                    self.flush()
                evaluated = (s.eval_every and done % s.eval_every == 0) or done == s.num_steps
                improved = False
                if evaluated:
                    self.flush()
                    improved = self.evaluate_dev(done)
                if evaluated or done % s.checkpoint_every == 0 or done == s.until:
                    self.flush()  # never checkpoint a state that a bad step froze
                    self.checkpoints.save_latest(self.state, self.meta_now())
                if improved:
                    # After the latest save: a stop between the two leaves a latest
                    # checkpoint whose meta names this step, and the resume saves the
                    # best from it (a best saved first could outlive its latest).
                    self.checkpoints.save_best(self.state, self.meta_now())
                # One process checks its flag every step; several agree at log boundaries.
                stop = (
                    any_process(signals.received is not None)
                    if multi_process and boundary
                    else (not multi_process and signals.received is not None)
                )
                if stop and done < s.until:
                    self.flush()
                    self.checkpoints.save_latest(self.state, self.meta_now())
                    self.writer.flush()
                    return {
                        "stopped_at": done,
                        "output_dir": self.output_dir,
                        "reason": signals.received or "signal in another process",
                    }
            self.flush()
        self.loop_end = time.perf_counter()
        if s.until < s.num_steps:
            self.writer.flush()
            return {"stopped_at": s.until, "output_dir": self.output_dir, "reason": "stop_after"}
        return None

    def summary_fields(self) -> dict[str, Any]:
        """What the summary takes from the loop: the last train and dev records, the best
        dev, the overflow count, the time and the rate."""
        rate = self.steps_per_s()
        return {
            "steps": int(self.state.step),
            "steps_this_session": self.settings.until - self.start,
            "step": self.last_train.get("step"),
            "loss": self.last_train.get("loss"),
            "accuracy": self.last_train.get("accuracy"),
            "density": self.last_train.get("density"),
            "density_per_head": self.last_train.get("density_per_head"),
            "first_loss": self.first_train.get("loss"),
            "final_train": scalars(self.last_train),
            "eval": scalars(self.last_dev) or None,
            "best_dev": self.meta.get("best"),
            "best_dev_metric": self.settings.best_metric,
            "best_dev_step": self.meta.get("best_step"),
            "overflow_total": self.overflow.total,
            "wall_time_s": self.wall_time(),
            "steps_per_s": rate,
            "examples_per_s": rate * self.settings.batch_size if math.isfinite(rate) else rate,
            "accumulation_steps": self.settings.accum,
        }
