"""The run directory: where it is, whether a run may resume into it, and its records cut
back to the step it resumes from.

* Where: ``--output_dir``, else ``config.output_dir``, else ``runs/<name>-<timestamp>``
  (a fresh directory every time; ``-2``, ``-3`` ... when two runs start in one second).
* Whether: a directory holding ``config.json`` is a run; resuming into it requires the
  new config to equal the saved one except for ``SAFE_TO_CHANGE`` fields (e.g.
  ``train.num_steps`` to extend a run). Otherwise ``check_resume`` raises a
  ``ConfigError`` naming every differing field, before anything is written.
* Records: ``truncate_records(output_dir, step)`` drops every record after the restored
  step (and the end-of-run test records) from ``metrics.jsonl``, ``metrics.csv`` and the
  TensorBoard event files, so no step is ever logged twice.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import glob
import json
import math
import os
import socket
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from sbm_jax.attention.registry import option_defaults
from sbm_jax.config_defaults import DEFAULTS
from sbm_jax.models.build import ENCODER_DEFAULTS
from sbm_jax.training.errors import ConfigError

CONFIG_FILE = "config.json"

# Fields a resumed run may change: how long it trains, how often it logs, evaluates and
# saves, where its data lives, and how the batch is laid out over devices. The mesh does
# not change a step's math. Gradient accumulation (train.max_per_device_batch, and
# mesh.data through it) gives the full batch's update for a deterministic model; under
# dropout or SBM sampling the update is the same in distribution but its random draws
# differ (micro-batch i draws from fold_in(state.rng, i), training/steps.py), so a run
# resumed with another number of passes does not repeat an uninterrupted run draw for
# draw; the trainer says so when it resumes.
SAFE_TO_CHANGE = (
    "output_dir",
    # Only names a new run's default directory (runs made before the LRA names followed
    # --config.seed recorded seed0 for a --config.seed=N run).
    "name",
    "train.num_steps",
    "train.num_epochs",
    "train.log_every",
    "train.eval_every",
    "train.max_per_device_batch",
    "checkpoint.every_steps",
    "checkpoint.max_to_keep",
    "mesh.data",
    "mesh.heads",
    "task.data_dir",
    # Only the initial parameters depend on it, and a resumed run restores them.
    "model.query_key_init",
    # Recomputation in the backward pass: the same gradients, less memory.
    "model.remat",
    # Which edge kernel computes the same sampled attention (float rounding aside).
    "model.attention_options.kernel",
    "data.tfds_data_dir",
)


# Fields added to the configs after runs were already made: a saved config without them
# matches a new one that holds their default (the behaviour those runs had). The values
# are read where each default is written.
ABSENT_MEANS = {
    **{
        name: DEFAULTS[name]
        for name in (
            "init_from",
            "train.max_per_device_batch",
            "train.halt_on_nonfinite",
            "checkpoint.best_metric",
            "checkpoint.best_mode",
        )
    },
    **{
        f"model.{name}": ENCODER_DEFAULTS[name]
        for name in ("position_embedding", "final_norm", "remat", "scaled_residual_init")
    },
    "model.attention_options.ste": option_defaults("sbm")["ste"],
    "task.truncate": False,  # LRA's (lra/train_task.py), before it could cut sequences
}


def timestamped_dir(name: str, root: str = "runs", now: float | None = None) -> str:
    """``<root>/<name>-<YYYYmmdd-HHMMSS>`` that does not exist yet (``-2``, ... appended
    when it does)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    base = os.path.join(root, f"{name}-{stamp}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def resolve_output_dir(config: Any, output_dir: str | None = None) -> str:
    """``output_dir`` (the flag), else ``config.output_dir``, else ``timestamped_dir``.

    In a multi-process job the timestamp is process 0's, so every process agrees.
    """
    if output_dir:
        return str(output_dir)
    if config.get("output_dir"):
        return str(config.output_dir)
    name = str(config.get("name", "run"))
    import jax

    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        now = float(multihost_utils.broadcast_one_to_all(np.asarray(time.time())))
        return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")
    return timestamped_dir(name)


def config_as_json(config: Any) -> dict[str, Any]:
    """The config as plain JSON values (tuples -> lists), as ``config.json`` holds it."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        if not tree and prefix:
            out[prefix[:-1]] = {}
        return out
    return {prefix[:-1]: tree}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (
            isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def config_differences(
    saved: Mapping[str, Any], new: Mapping[str, Any], safe: tuple[str, ...] = SAFE_TO_CHANGE
) -> list[str]:
    """``"config.<field> <saved> -> <new>"`` for every field that differs, except ``safe``
    ones (a field present on one side only counts as differing)."""
    old_flat, new_flat = _flatten(saved), _flatten(new)
    out = []
    for key in sorted(set(old_flat) | set(new_flat)):
        if key in safe or any(key.startswith(s + ".") for s in safe):
            continue
        missing = object()
        a, b = old_flat.get(key, missing), new_flat.get(key, missing)
        if a is missing and key in ABSENT_MEANS and _same(ABSENT_MEANS[key], b):
            continue
        if a is missing or b is missing or not _same(a, b):
            shown_a = "(none)" if a is missing else json.dumps(a)
            shown_b = "(none)" if b is missing else json.dumps(b)
            out.append(f"config.{key} {shown_a} -> {shown_b}")
    return out


def saved_config(output_dir: str) -> dict[str, Any] | None:
    """The ``config.json`` of a run in ``output_dir``, or None when it holds none."""
    path = os.path.join(output_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"output_dir={output_dir!r}: cannot read its {CONFIG_FILE}: {e}"
        ) from None


#: Files a run writes that a new run in the same folder would replace.
RECORD_FILES = ("metrics.jsonl", "metrics.csv", "summary.json")


def check_resume(output_dir: str, config: Any) -> bool:
    """True when ``output_dir`` holds a run that ``config`` may resume; False when it
    holds none.

    Raises:
      ConfigError: one line naming every field whose value differs from the saved run's
        (``SAFE_TO_CHANGE`` fields may differ).
    """
    saved = saved_config(output_dir)
    if saved is None:
        latest = os.path.join(output_dir, "checkpoints", "latest")
        if os.path.isdir(latest) and any(n.isdigit() for n in os.listdir(latest)):
            raise ConfigError(
                f"output_dir={output_dir!r} holds checkpoints but no {CONFIG_FILE}, so this "
                "config cannot be checked against the run's; choose another --output_dir"
            )
        records = [n for n in RECORD_FILES if os.path.isfile(os.path.join(output_dir, n))]
        if records:
            raise ConfigError(
                f"output_dir={output_dir!r} holds {', '.join(records)} but no {CONFIG_FILE}: "
                "a new run would overwrite them; choose another --output_dir"
            )
        return False
    diffs = config_differences(saved, config_as_json(config))
    if diffs:
        raise ConfigError(
            f"output_dir={output_dir!r} holds a run with another config ({len(diffs)} "
            f"field{'s' if len(diffs) > 1 else ''} differ: {'; '.join(diffs)}); resume it "
            "with its own settings or choose another --output_dir"
        )
    return True


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """A run directory checked against a config (:func:`check_run_folder`): ``path``,
    and whether it holds a run that the config resumes (``resuming``)."""

    path: str
    resuming: bool


def check_run_folder(config: Any, output_dir: str | None = None) -> RunFolder:
    """Where ``config`` trains (:func:`resolve_output_dir`) and whether it may: the one
    check of the run directory (:func:`check_resume`), before anything is written.

    Raises:
      ConfigError: as ``check_resume``.
    """
    path = resolve_output_dir(config, output_dir)
    return RunFolder(path, check_resume(path, config))


@contextlib.contextmanager
def open_run_folder(folder: RunFolder, primary: bool) -> Iterator[str]:
    """Create the checked ``folder`` and probe its parts (:func:`prepare_output_dir`);
    process 0 (``primary``) holds its :class:`RunLock` until the block ends, however it
    ends. Yields the folder's path.

    Raises:
      ConfigError: a part that cannot be written, or a folder in use by another run.
    """
    path = prepare_output_dir(folder.path)
    lock = RunLock(path) if primary else None  # before anything in the folder is read
    try:
        yield path
    finally:
        if lock is not None:
            lock.release()


#: What a run writes inside its folder: directories, then files. Each one that exists
#: already (a run being resumed, or a folder reused) must be of its kind and writable.
RUN_DIRECTORIES = ("checkpoints", "checkpoints/latest", "checkpoints/best", "tensorboard")
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "metrics.csv", "metrics.png", "summary.json", ".lock")


def prepare_output_dir(path: str) -> str:
    """Create ``path`` (and parents) and check that the run can write what it writes
    there (:data:`RUN_DIRECTORIES`, :data:`RUN_FILES`): a failure raises ``ConfigError``
    naming output_dir and the part, before any training, not at the first checkpoint.

    Directories are probed by creating and removing a file in them: ``os.access`` says
    yes to root on a read-only mount, and no where ACLs would allow.
    """
    if not path:
        raise ConfigError("output_dir is empty")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir={path!r} cannot be created: {e.strerror or e}") from None
    if not _can_write_in(path):
        raise ConfigError(f"output_dir={path!r} is not writable")
    for name in RUN_DIRECTORIES:
        part = os.path.join(path, name)
        if os.path.lexists(part) and not os.path.isdir(part):
            raise ConfigError(f"output_dir={path!r}: {name} is not a directory (move it away)")
        if os.path.isdir(part) and not _can_write_in(part):
            raise ConfigError(f"output_dir={path!r}: {name}/ is not writable")
    for name in RUN_FILES:
        part = os.path.join(path, name)
        if os.path.isdir(part):
            raise ConfigError(f"output_dir={path!r}: {name} is a directory (move it away)")
        if os.path.exists(part) and not os.access(part, os.W_OK):
            raise ConfigError(f"output_dir={path!r}: {name} is not writable")
    return path


LOCK_FILE = ".lock"


class RunLock:
    """An exclusive ``flock`` on ``<output_dir>/.lock``, held while a trainer writes the
    run: a second trainer started into the same folder (a command run twice) is refused
    instead of interleaving checkpoints and records with the first.

    The kernel drops the lock when its holder dies however it dies, so a crash or a
    preemption never leaves a stale lock behind (the file stays then, unlocked: it
    means nothing). A run that ends removes the file, still holding the lock; a
    trainer that opened the file before the removal and locks it after finds that
    the path no longer names it and starts over with a new file. Where the file
    system has no ``flock`` (some network mounts, Windows) the run goes on unlocked.
    """

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._file: Any = None
        try:
            import fcntl
        except ImportError:  # Windows
            return
        while True:
            handle = open(self.path, "a+", encoding="utf-8")  # held until release()
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = " ".join(handle.read().split()) or "another process"
                handle.close()
                raise ConfigError(
                    f"output_dir={output_dir!r} is in use by a run that is still training "
                    f"({holder}); wait for it, stop it, or choose another --output_dir"
                ) from None
            except OSError:  # no flock on this file system: unlocked
                handle.close()
                return
            if _same_file(handle.fileno(), self.path):
                break
            handle.close()  # removed by the run that held it: lock the new file
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        """Remove the lock file and drop the lock."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                if _same_file(self._file.fileno(), self.path):
                    os.remove(self.path)
            self._file.close()
            self._file = None


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _can_write_in(directory: str) -> bool:
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def _kept(record: Mapping[str, Any], step: int) -> bool:
    """A record survives a resume from ``step``: not after it, and not an end-of-run
    test record (those are written again when the run ends)."""
    if str(record.get("split", "train")).startswith("test"):
        return False
    record_step = record.get("step")
    return not isinstance(record_step, (int, float)) or record_step <= step


def truncate_records(output_dir: str, step: int) -> dict[str, int]:
    """Cut ``metrics.jsonl``, ``metrics.csv`` and the TensorBoard events of ``output_dir``
    back to ``step`` (see ``_kept``); returns how many records each lost."""
    dropped = {"jsonl": 0, "csv": 0, "tensorboard": 0}
    path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        keep = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash mid-write
            if _kept(record, step):
                keep.append(line if line.endswith("\n") else line + "\n")
        dropped["jsonl"] = len(lines) - len(keep)
        write_atomically(path, "".join(keep))
    path = os.path.join(output_dir, "metrics.csv")
    if os.path.isfile(path):
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if rows:
            header, body = rows[0], rows[1:]
            keep_rows = [r for r in body if r and _csv_step(r) is not None and _csv_step(r) <= step]  # type: ignore[operator]
            dropped["csv"] = len(body) - len(keep_rows)
            with open(path + ".tmp", "w", newline="", encoding="utf-8") as f:
                csv.writer(f).writerows([header, *keep_rows])
            os.replace(path + ".tmp", path)
    for events in sorted(
        glob.glob(os.path.join(output_dir, "tensorboard", "events.out.tfevents.*"))
    ):
        dropped["tensorboard"] += _truncate_events(events, step)
    return dropped


def _csv_step(row: list[str]) -> float | None:
    try:
        return float(row[0])
    except (ValueError, IndexError):
        return None


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a process killed
    mid-write leaves the old file or the new one, never a truncated one (a truncated
    summary.json would read as a finished run to the sweep and crash the report). The
    text is on disk before the rename (fsync)."""
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        with contextlib.suppress(OSError):  # a full disk: no half file left beside it
            os.remove(path + ".tmp")
        raise
    os.replace(path + ".tmp", path)


def _read_tfrecords(path: str) -> list[bytes]:
    """Payloads of a TFRecord file; a record cut short by a crash ends the list."""
    from tensorboardX.record_writer import masked_crc32c

    with open(path, "rb") as f:
        blob = f.read()
    records, pos = [], 0
    while pos + 12 <= len(blob):
        header = blob[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", blob[pos + 8 : pos + 12])
        end = pos + 12 + length + 4
        if length_crc != masked_crc32c(header) or end > len(blob):
            break
        data = blob[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length : end])
        if data_crc != masked_crc32c(data):
            break
        records.append(data)
        pos = end
    return records


def _truncate_events(path: str, step: int) -> int:
    """Rewrite one event file without the events after ``step`` (or of the test split)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    payloads = _read_tfrecords(path)
    keep = []
    for payload in payloads:
        event = Event.FromString(payload)
        tags = [v.tag for v in event.summary.value]
        if event.HasField("summary") and (
            event.step > step or any(t.startswith("test") for t in tags)
        ):
            continue
        keep.append(payload)
    if len(keep) == len(payloads) and os.path.getsize(path) == sum(len(p) + 16 for p in payloads):
        return 0
    with open(path + ".tmp", "wb") as f:
        for data in keep:
            header = struct.pack("<Q", len(data))
            f.write(header + struct.pack("<I", masked_crc32c(header)))
            f.write(data + struct.pack("<I", masked_crc32c(data)))
    os.replace(path + ".tmp", path)
    return len(payloads) - len(keep)
