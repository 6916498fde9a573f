"""Orbax checkpoints of a run: the latest few (for resuming) and the best on dev; and
the parameters of another run's checkpoint (``config.init_from``).

Layout under ``<output_dir>/checkpoints``: ``latest/<step>/`` (kept: ``max_to_keep``)
and ``best/<step>/`` (kept: 1). Each holds the train state's pytree (``step``,
``params``, ``opt_state``, ``rng``) and a JSON ``meta`` dict (the trainer's bookkeeping:
best dev metric so far and the step of the last dev evaluation, the data position
``data_index``, the batch size, the number of gradient-accumulation passes per step and
the resolved config the state was trained with). Restoring takes a target state (a fresh
one from the same config, or its ``abstract_state``: shapes, dtypes and shardings
without device buffers) so optax's state types and the arrays' shardings come back as
they were.

``save_snapshot`` / ``restore_snapshot`` keep one state in a directory of its own (the
trainer's non-finite dumps). In a multi-process job every process calls every save and
restore (orbax coordinates them; each process writes its own shards).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging as logging_std
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from sbm_jax.training.errors import ConfigError, NoSpaceError, is_no_space
from sbm_jax.training.run_dir import write_atomically
from sbm_jax.training.state import TrainState

CHECKPOINT_DIR = "checkpoints"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Orbax logs several INFO lines per save and restore; keep only warnings."""
    before = logging.get_verbosity()
    logging.set_verbosity(min(before, logging.WARNING))  # absl: lower = quieter
    try:
        yield
    finally:
        logging.set_verbosity(before)


def _tree(state: TrainState) -> dict[str, Any]:
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "rng": state.rng,
    }


def abstract_tree(tree: Any) -> Any:
    """Arrays -> ``jax.ShapeDtypeStruct`` with their sharding (works on donated arrays)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


def abstract_state(state: TrainState, shardings: Any) -> TrainState:
    """``state`` (host values: a fresh state before it is placed) as a restore target of
    ``jax.ShapeDtypeStruct`` leaves with ``shardings`` (a pytree shaped like ``state``,
    e.g. ``sharding.state_sharding``): what a restore needs, without holding a second
    state (parameters and Adam moments) on the devices."""
    shapes = jax.eval_shape(lambda tree: tree, state)
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type
        ),
        shapes,
        shardings,
    )


def _save_to(
    manager: ocp.CheckpointManager, state: TrainState, meta: dict[str, Any], step: int | None = None
) -> None:
    """Save ``state`` and ``meta`` under ``step`` (default ``state.step``); no-op if present."""
    step = int(state.step) if step is None else int(step)
    if step in manager.all_steps():
        return
    _check_space(os.fspath(manager.directory), state, step)
    undo = _silence_failed_writes()
    try:
        with _quiet():
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(_tree(state)), meta=ocp.args.JsonSave(meta)
                ),
            )
            manager.wait_until_finished()
    except Exception as e:
        if not is_no_space(e):
            undo()
            raise
        # The silencing stays (orbax's abandoned writes report until exit). Orbax leaves
        # its half-written <step>.orbax-checkpoint-tmp-* folder behind: removed.
        directory = os.fspath(manager.directory)
        for tmp in glob.glob(os.path.join(directory, "*.orbax-checkpoint-tmp*")):
            shutil.rmtree(tmp, ignore_errors=True)
        raise NoSpaceError(
            f"no space left on the device holding {directory} (saving the checkpoint of "
            f"step {step}; its partial copy is removed)"
        ) from None
    undo()


def _mentions_no_space(record: logging_std.LogRecord) -> bool:
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 (a malformed record is not ours to judge)
        text = ""
    texts = ("No space left on device", "Disk quota exceeded", "Event loop is closed")
    return is_no_space(record.exc_info[1] if record.exc_info else None) or any(
        t in text for t in texts
    )


class _NoSpaceFilter(logging_std.Filter):
    def filter(self, record: logging_std.LogRecord) -> bool:
        return not _mentions_no_space(record)


def _silence_failed_writes() -> Callable[[], None]:
    """Drop the reports of a save that fails for lack of space; returns the undo.

    Orbax's and TensorStore's writer threads each log the failure with a traceback
    (absl's logger), their futures and closed event loop report again through the
    ``asyncio`` logger, ``threading.excepthook`` and ``sys.unraisablehook``: a hundred
    lines burying the one that says what happened (``NoSpaceError``). Only reports of a
    full disk are dropped."""
    log_filter = _NoSpaceFilter()
    loggers = [logging_std.getLogger(n) for n in ("absl", "asyncio", "")]
    for logger in loggers:
        logger.addFilter(log_filter)
    handlers = [h for logger in loggers for h in logger.handlers]
    for handler in handlers:
        handler.addFilter(log_filter)
    previous_unraisable, previous_thread = sys.unraisablehook, threading.excepthook

    def unraisable(info: Any) -> None:
        closed = isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(
            info.exc_value
        )
        if not (closed or is_no_space(info.exc_value)):
            previous_unraisable(info)

    def thread_hook(args: Any) -> None:
        if not is_no_space(args.exc_value):
            previous_thread(args)

    sys.unraisablehook, threading.excepthook = unraisable, thread_hook

    def undo() -> None:
        for logger in loggers:
            logger.removeFilter(log_filter)
        for handler in handlers:
            handler.removeFilter(log_filter)
        if sys.unraisablehook is unraisable:
            sys.unraisablehook = previous_unraisable
        if threading.excepthook is thread_hook:
            threading.excepthook = previous_thread

    return undo


#: Room kept beyond the last checkpoint's size (meta grows a little), and beyond the raw
#: state bytes before the first checkpoint (orbax's metadata, sharding file and locks).
_SPACE_MARGIN = 64 << 10
_FIRST_SAVE_MARGIN = 192 << 10


def _checkpoint_bytes(directory: str, state: TrainState) -> int:
    """About what one checkpoint of ``state`` takes on disk: the largest one already in
    ``directory`` (compressed, as orbax writes them), else the state's raw bytes."""
    sizes = []
    for entry in os.listdir(directory) if os.path.isdir(directory) else ():
        if entry.isdigit():
            total = 0
            for root, _, files in os.walk(os.path.join(directory, entry)):
                total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
            sizes.append(total)
    if sizes:
        return max(sizes) + _SPACE_MARGIN
    leaves = jax.tree.leaves(_tree(state))
    return sum(int(getattr(x, "nbytes", 8)) for x in leaves) + _FIRST_SAVE_MARGIN


def _check_space(directory: str, state: TrainState, step: int) -> None:
    """Raise ``NoSpaceError`` before a save that cannot fit the free space under
    ``directory``: a save that fails half-way floods stderr from orbax's threads and
    leaves a temporary folder behind (removed by ``_save_to`` if it happens anyway)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return
    need = _checkpoint_bytes(directory, state)
    if free < need:
        raise NoSpaceError(
            f"no space left on the device holding {directory}: the checkpoint of step "
            f"{step} needs about {need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free"
        )


def _restore_from(
    manager: ocp.CheckpointManager, target: TrainState, step: int | None
) -> tuple[TrainState, dict[str, Any]] | None:
    """(state, meta) saved under ``step`` (default the newest), or None when there is none."""
    step = manager.latest_step() if step is None else step
    if step is None:
        return None
    with _quiet():
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_tree(_tree(target))),
                meta=ocp.args.JsonRestore(),
            ),
        )
    tree = restored["state"]
    state = target.replace(
        step=tree["step"], params=tree["params"], opt_state=tree["opt_state"], rng=tree["rng"]
    )
    return state, dict(restored["meta"] or {})


def save_snapshot(directory: str, state: TrainState, meta: dict[str, Any]) -> str:
    """Save one state (and its JSON ``meta``) as ``<directory>/<state.step>/``.

    Returns the checkpoint's directory. Every process of a multi-process job calls it.
    """
    with _quiet():
        manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(create=True)
        )
    try:
        _save_to(manager, state, meta)
    finally:
        with _quiet():
            manager.close()
    return os.path.join(os.path.abspath(directory), str(int(state.step)))


def restore_snapshot(
    directory: str, target: TrainState, step: int | None = None
) -> tuple[TrainState, dict[str, Any]]:
    """(state, meta) of the checkpoint under ``directory`` saved at ``step`` (default the
    newest): a ``save_snapshot`` folder, or a run's ``checkpoints/latest``.

    Raises:
      FileNotFoundError: naming ``directory`` (and ``step``) when it holds no such
        checkpoint.
    """
    path = os.path.abspath(directory)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path}")
    with _quiet():
        manager = ocp.CheckpointManager(path)
    try:
        if step is not None and step not in manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint of step {step} under {path}; it has {list(manager.all_steps())}"
            )
        restored = _restore_from(manager, target, step)
    finally:
        with _quiet():
            manager.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint under {path}")
    return restored


class RunCheckpoints:
    """The latest and best-dev checkpoints of one run.

    Args:
      directory: where to keep them (created).
      max_to_keep: latest checkpoints kept (>= 1).
    """

    def __init__(self, directory: str, max_to_keep: int = 2) -> None:
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"checkpoint.max_to_keep={max_to_keep!r} must be an integer >= 1")
        self.directory = os.path.abspath(directory)
        with _quiet():
            self._latest = ocp.CheckpointManager(
                os.path.join(self.directory, "latest"),
                options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            )
            self._best = ocp.CheckpointManager(
                os.path.join(self.directory, "best"),
                options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
            )

    def save_latest(self, state: TrainState, meta: dict[str, Any]) -> None:
        """Save ``state`` as a latest checkpoint at ``state.step`` (no-op if present)."""
        _save_to(self._latest, state, meta)

    def save_best(self, state: TrainState, meta: dict[str, Any]) -> None:
        """Replace the best checkpoint with ``state``."""
        _save_to(self._best, state, meta)

    def update_latest_meta(self, step: int, meta: dict[str, Any]) -> None:
        """Replace the ``meta`` of the latest checkpoint of ``step`` (its state stays):
        bookkeeping done after that state was saved, e.g. a dev evaluation of a resumed
        run's final state. Process 0 rewrites orbax's JSON file through a temporary file
        and a rename (a crash leaves the old meta or the new one); no-op when the
        checkpoint is not there."""
        path = os.path.join(str(self._latest.directory), str(int(step)), "meta", "metadata")
        if jax.process_index() != 0 or not os.path.isfile(path):
            return
        write_atomically(path, json.dumps(meta))

    def latest_step(self) -> int | None:
        """Step of the newest latest checkpoint, or None."""
        return self._latest.latest_step()

    def best_step(self) -> int | None:
        """Step of the best checkpoint, or None."""
        return self._best.latest_step()

    def restore_latest(
        self,
        target: TrainState,
        on_unreadable: Callable[[int, str, Exception], None] | None = None,
    ) -> tuple[TrainState, dict[str, Any]] | None:
        """(state, meta) of the newest readable latest checkpoint, or None when there is
        none.

        ``target``: a state of the same structure (e.g. fresh from the same config); its
        arrays' shapes, dtypes and shardings are those restored.

        A checkpoint that cannot be read (a truncated file, a damaged ``meta``) is passed
        over for the next older one: it is moved to ``<directory>/unreadable/latest-<step>``
        (kept, never deleted; left in place, a later save at its step would be skipped)
        and ``on_unreadable(step, moved_to, error)`` is called. In a multi-process job
        nothing is moved: the error names the step to remove.

        Raises:
          CheckpointError: naming the directory and the first error when checkpoints
            exist but none can be read.
        """
        steps = sorted(self._latest.all_steps(), reverse=True)
        failed: list[tuple[int, Exception]] = []
        for step in steps:
            try:
                restored = _restore_quietly(self._latest, target, step)
            except Exception as err:  # orbax, tensorstore and json raise many types
                if jax.process_count() > 1:
                    raise CheckpointError(
                        f"checkpoint {self._latest.directory}/{step} is unreadable "
                        f"({short_error(err)}); remove it to resume from the one before"
                    ) from err
                failed.append((step, err))
                continue
            for bad, bad_err in failed:
                moved = self._set_aside(self._latest, "latest", bad)
                if on_unreadable is not None:
                    on_unreadable(bad, moved, bad_err)
            return restored
        if failed:
            first_step, first_err = failed[0]
            raise CheckpointError(
                f"no readable checkpoint in {self._latest.directory} (steps "
                f"{[s for s, _ in failed]}; step {first_step}: {short_error(first_err)}); remove "
                "them to start over, or use another output_dir"
            ) from first_err
        return None

    def _set_aside(self, manager: ocp.CheckpointManager, kind: str, step: int) -> str:
        """Move ``<kind>/<step>`` out of orbax's view, to ``unreadable/<kind>-<step>``."""
        source = os.path.join(str(manager.directory), str(step))
        target = os.path.join(self.directory, "unreadable", f"{kind}-{step}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        n = 1
        while os.path.exists(target):
            n += 1
            target = os.path.join(self.directory, "unreadable", f"{kind}-{step}-{n}")
        shutil.move(source, target)
        with _quiet():
            manager.reload()
        return target

    def drop_best_after(self, step: int) -> int | None:
        """Delete a best checkpoint saved after ``step`` (by a session whose latest
        checkpoint was lost or never written): the run resumes from ``step`` and will
        choose its best again. Returns the dropped step, or None."""
        best = self._best.latest_step()
        if best is None or best <= step:
            return None
        with _quiet():
            self._best.delete(best)
        return best

    def restore_best(
        self,
        target: TrainState,
        on_unreadable: Callable[[int, str, Exception], None] | None = None,
    ) -> tuple[TrainState, dict[str, Any]] | None:
        """(state, meta) of the best checkpoint, or None when there is none.

        With ``on_unreadable``, a best checkpoint that cannot be read is moved to
        ``<directory>/unreadable/best-<step>``, reported, and None is returned (the
        caller then uses its own state); without it, the error propagates.
        """
        step = self._best.latest_step()
        try:
            return _restore_quietly(self._best, target, step)
        except Exception as err:  # orbax, tensorstore and json raise many types
            if on_unreadable is None or step is None or jax.process_count() > 1:
                raise
            on_unreadable(step, self._set_aside(self._best, "best", step), err)
            return None

    def close(self) -> None:
        with _quiet():
            self._latest.close()
            self._best.close()


#: Orbax's and TensorStore's messages when a shard of a damaged checkpoint cannot be read.
_READ_ERRORS = ("Encountered error while reading array index", "in OCDBT database at")


def _is_failed_read(exc: BaseException | None) -> bool:
    return exc is not None and (
        any(text in str(exc) for text in _READ_ERRORS)
        or (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
    )


class _FailedReadFilter(logging_std.Filter):
    def filter(self, record: logging_std.LogRecord) -> bool:
        return not (record.exc_info and _is_failed_read(record.exc_info[1]))


def _silence_failed_reads() -> Callable[[], None]:
    """Drop the reports of a failed read of a damaged checkpoint; returns the undo.

    When a restore fails, orbax's abandoned read coroutines and its closed event loop
    report themselves during the attempt and for the rest of the process (thousands of
    traceback lines, at garbage collection, through ``sys.unraisablehook``, the
    ``asyncio`` logger and a ``RuntimeWarning``), burying the one warning that matters.
    Exactly those reports are dropped; everything else still reaches its hook. Callers
    install it around a restore and undo it when the restore succeeded (nothing to
    drop), or keep it after a failure and filter the warning then
    (:func:`_restore_quietly`)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _is_failed_read(unraisable.exc_value):
            previous(unraisable)

    sys.unraisablehook = hook
    log_filter = _FailedReadFilter()
    logging_std.getLogger("asyncio").addFilter(log_filter)

    def undo() -> None:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous
        logging_std.getLogger("asyncio").removeFilter(log_filter)

    return undo


def _restore_quietly(
    manager: ocp.CheckpointManager, target: TrainState, step: int | None
) -> tuple[TrainState, dict[str, Any]] | None:
    """:func:`_restore_from`, with a damaged checkpoint's after-effects silenced."""
    undo = _silence_failed_reads()
    try:
        restored = _restore_from(manager, target, step)
    except Exception:
        # The silencing stays: the abandoned reads report at collection, and warn once.
        warnings.filterwarnings(
            "ignore", message="coroutine '_read_array_index_and_device_put' was never awaited"
        )
        raise
    undo()
    return restored


class CheckpointError(RuntimeError):
    """A run's checkpoints exist but cannot be used; the message names them."""


def short_error(err: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` of ``err``'s root cause (orbax wraps the
    TensorStore error that names the file), at most ``limit`` characters."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checkpoint_steps(path: str) -> list[int]:
    """The steps saved in a checkpoint folder (``checkpoints/latest``, ``.../best``, a
    ``save_snapshot`` directory), ascending; [] when the folder does not exist."""
    if not os.path.isdir(path):
        return []
    return sorted(int(name) for name in os.listdir(path) if name.isdigit())


def find_checkpoint(path: str, field: str = "config.init_from") -> str:
    """The one checkpoint directory (``.../<step>``) that ``path`` names.

    ``path`` is a run directory (its best checkpoint, else its newest latest one), a run's
    ``checkpoints/``, ``checkpoints/best`` or ``checkpoints/latest`` folder (the newest
    step there), or a step directory itself. Errors name ``field``.

    Raises:
      FileNotFoundError: naming ``field`` and the path, when nothing there is a checkpoint.
    """
    if not path:
        raise FileNotFoundError(f"{field} is empty; give a run directory or a checkpoint")
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{field}={path!r} does not exist")
    if os.path.basename(path).isdigit() and os.path.isdir(os.path.join(path, "state")):
        return path
    candidates = [
        os.path.join(path, CHECKPOINT_DIR, "best"),
        os.path.join(path, CHECKPOINT_DIR, "latest"),
        os.path.join(path, "best"),
        os.path.join(path, "latest"),
        path,
    ]
    for folder in candidates:
        steps = [s for s in checkpoint_steps(folder) if os.path.isdir(os.path.join(folder, str(s)))]
        if steps:
            return os.path.join(folder, str(steps[-1]))
    raise FileNotFoundError(f"{field}={path!r} holds no checkpoint")


def run_dir_of_checkpoint(checkpoint: str) -> str:
    """The run directory above ``.../checkpoints/{best,latest}/<step>`` (else its parent)."""
    parts = os.path.abspath(checkpoint).split(os.sep)
    if len(parts) >= 4 and parts[-3] == CHECKPOINT_DIR:
        return os.sep.join(parts[:-3])
    return os.path.dirname(os.path.abspath(checkpoint))


def read_checkpoint_meta(checkpoint: str) -> dict[str, Any]:
    """The JSON ``meta`` of one checkpoint step directory (``find_checkpoint``)."""
    directory, step = os.path.split(os.path.abspath(checkpoint))
    with _quiet():
        manager = ocp.CheckpointManager(directory)
        try:
            restored = manager.restore(
                int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        finally:
            manager.close()
    return dict(restored["meta"] or {})


def load_params(checkpoint: str) -> Any:
    """The ``params`` pytree (host arrays) of one checkpoint step directory.

    Restored onto this process's first device whatever devices saved it: without a
    target, orbax rebuilds the saved sharding and fails ("Topology mismatch") when the
    device count differs, e.g. a pretraining run on 2 GPUs fine-tuned on 1.
    """
    directory, step = os.path.split(os.path.abspath(checkpoint))
    with _quiet():
        manager = ocp.CheckpointManager(
            directory,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        try:
            saved = manager.item_metadata(int(step))["state"]
            here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            target = jax.tree.map(
                lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here), saved
            )
            restored = manager.restore(
                int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )
        finally:
            manager.close()
    return jax.tree.map(lambda x: jax.device_get(x), restored["state"]["params"])


def check_same_tree(fresh: Any, loaded: Any, field: str = "config.init_from") -> Any:
    """``loaded`` if it has ``fresh``'s structure and shapes (cast to its dtypes), else a
    ``ConfigError`` naming ``field`` and the first differing parameter."""
    fresh_leaves = dict(jax.tree_util.tree_leaves_with_path(fresh))
    loaded_leaves = dict(jax.tree_util.tree_leaves_with_path(loaded))
    fresh_keys = {jax.tree_util.keystr(k): v for k, v in fresh_leaves.items()}
    loaded_keys = {jax.tree_util.keystr(k): v for k, v in loaded_leaves.items()}
    missing = sorted(set(fresh_keys) - set(loaded_keys))
    extra = sorted(set(loaded_keys) - set(fresh_keys))
    if missing or extra:
        raise ConfigError(
            f"{field}: the checkpoint's parameters differ from the model's: missing "
            f"{missing[:3]}, unexpected {extra[:3]}"
        )
    for key, value in fresh_keys.items():
        if tuple(value.shape) != tuple(loaded_keys[key].shape):
            raise ConfigError(
                f"{field}: parameter {key} has shape {tuple(value.shape)} in the model but "
                f"{tuple(loaded_keys[key].shape)} in the checkpoint"
            )
    return jax.tree.map(lambda new, old: old.astype(new.dtype), fresh, loaded)
