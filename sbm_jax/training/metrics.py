"""Host-side metric output: JSONL, CSV and TensorBoard writers and a plain-text progress bar."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

import numpy as np

CSV_COLUMNS = ("step", "loss", "accuracy", "density")


def to_python(value: Any) -> Any:
    """Arrays and numpy scalars -> floats / nested lists, recursively through dicts."""
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    array = np.asarray(value)
    if array.ndim == 0:
        x = array.item()
        return float(x) if isinstance(x, (float, np.floating)) else x
    return array.tolist()


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN / inf float (in dicts and lists) replaced by None."""
    if isinstance(value, Mapping):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# Record fields that are bookkeeping, not metrics: not sent to TensorBoard.
TENSORBOARD_SKIP = frozenset({"step", "split", "time_s"})
TENSORBOARD_DIR = "tensorboard"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _index_names(name: str, depth: int) -> tuple[str, ...]:
    """Labels for the indices of a ``depth``-deep nested list stored under ``name``."""
    if name.endswith("per_head") and depth in (1, 2):
        return ("layer", "head")[-depth:]
    if name.endswith("per_layer") and depth == 1:
        return ("layer",)
    return ("",) * depth


def _list_depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list) and value:
        depth, value = depth + 1, value[0]
    return depth


def tensorboard_scalars(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The ``(name, value)`` scalars of a ``to_python`` record, in key order.

    Numbers are kept as they are (``loss`` -> ``loss``); dicts are walked with ``/``
    (``density_per_head`` {"encoder/block_0/attention": [..]} ->
    ``density_per_head/encoder/block_0/attention/head0``); nested lists are indexed, with
    ``layer``/``head`` labels under a ``*_per_head`` key (``density_per_head`` [[..], [..]]
    -> ``density_per_head/layer0_head1``) and plain indices otherwise (``x/0_1``). Strings,
    booleans, ``None`` and the ``step``/``split``/``time_s`` bookkeeping are skipped.
    """

    def walk(name: str, value: Any, leaf_of: str) -> Iterator[tuple[str, float]]:
        if _is_number(value):
            yield name, float(value)
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                yield from walk(f"{name}/{key}", value[key], leaf_of)
        elif isinstance(value, list):
            labels = _index_names(leaf_of, _list_depth(value))
            yield from walk_list(name, value, labels, ())

    def walk_list(
        name: str, value: Any, labels: tuple[str, ...], index: tuple[int, ...]
    ) -> Iterator[tuple[str, float]]:
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from walk_list(name, item, labels, (*index, i))
        elif _is_number(value):
            padded = labels + ("",) * (len(index) - len(labels))
            suffix = "_".join(f"{label}{i}" for label, i in zip(padded, index, strict=False))
            yield f"{name}/{suffix}", float(value)

    for key in sorted(record, key=str):
        if key in TENSORBOARD_SKIP:
            continue
        yield from walk(str(key), record[key], str(key))


class _TensorBoardEvents:
    """A synchronous TensorBoard event file: one ``Event`` per record, on disk at ``flush``.

    Built on tensorboardX's ``EventsWriter`` (the record writer under its
    ``SummaryWriter``) rather than ``SummaryWriter`` itself, whose ``flush`` does not
    drain its background queue, so events could still be in memory after a flush.
    """

    def __init__(self, logdir: str) -> None:
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar
        except ImportError as e:
            raise ImportError(
                "MetricsWriter(tensorboard=True) needs the tensorboardX package "
                "(pip install tensorboardX); pass tensorboard=False to write only "
                "metrics.jsonl and metrics.csv"
            ) from e
        self._event_cls, self._scalar = Event, scalar
        os.makedirs(logdir, exist_ok=True)
        # tensorboardX names files by the second and host only; the unique suffix keeps a
        # writer reopened within the same second (a quick resume) from truncating the last.
        suffix = f".{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._writer = EventsWriter(os.path.join(logdir, "events"), suffix)

    def write(self, step: int, scalars: list[tuple[str, float]]) -> None:
        if not scalars:
            return
        event = self._event_cls(wall_time=time.time(), step=step)
        for tag, value in scalars:
            event.summary.value.extend(self._scalar(tag, value).value)
        self._writer.write_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WholeLines:
    """A text file appended to only in whole lines: ``write`` buffers, ``flush``
    appends the buffer and, if that fails (``ENOSPC``), truncates the file back to its
    size before the append and raises."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pending: list[str] = []
        with open(path, "a", encoding="utf-8"):
            pass  # exists from the start, as the records of a run that logged nothing

    def write(self, text: str) -> int:
        self._pending.append(text)
        return len(text)

    def flush(self) -> None:
        if not self._pending:
            return
        data = "".join(self._pending).encode("utf-8")
        self._pending.clear()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def close(self) -> None:
        self.flush()


class MetricsWriter:
    """Appends one JSON record per line to ``metrics.jsonl``, training rows to
    ``metrics.csv`` (columns step, loss, accuracy, density; density empty when the
    mechanism sows none) and, with ``tensorboard=True``, every numeric scalar to
    TensorBoard event files in ``<output_dir>/tensorboard/``. Appending lets a restarted run
    continue the same files; TensorBoard gets a new event file per writer (it merges them).

    TensorBoard tags are ``<split>/<name>`` with the record's ``split`` ("train" when
    absent), at the record's ``step``: ``train/loss``, ``dev/accuracy``,
    ``train/density_per_head/encoder/block_0/attention/head1``; see
    ``tensorboard_scalars`` for the naming. View with ``tensorboard --logdir <output_dir>``
    (or the parent of several runs). ``tensorboardX`` is imported only when
    ``tensorboard=True``.
    """

    def __init__(self, output_dir: str, tensorboard: bool = True) -> None:
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl")
        self.csv_path = os.path.join(output_dir, "metrics.csv")
        self.tensorboard_dir: str | None = None
        self._tb: _TensorBoardEvents | None = None
        if tensorboard:
            self.tensorboard_dir = os.path.join(output_dir, TENSORBOARD_DIR)
            self._tb = _TensorBoardEvents(self.tensorboard_dir)
        new_csv = not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0
        # Lines wait here until flush() appends them whole: a write that fails (a full
        # disk) is cut back to the last whole line, never leaving half a record.
        self._jsonl = _WholeLines(self.jsonl_path)
        self._csv_file = _WholeLines(self.csv_path)
        self._csv = csv.writer(self._csv_file)
        if new_csv:
            self._csv.writerow(CSV_COLUMNS)

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record; ``split`` "train" (default) rows also go to the CSV.

        With TensorBoard on, the record needs an integer ``step``.
        """
        record = to_python(record)
        split = record.get("split", "train")
        step = record.get("step")
        if self._tb is not None:
            if isinstance(step, float) and step.is_integer():
                step = int(step)
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(
                    f"MetricsWriter.write: record 'step' must be an integer for TensorBoard, "
                    f"got {step!r}; pass tensorboard=False to log records without a step"
                )
        # Strict JSON: NaN / inf are written as null (json.dumps' bare NaN tokens are
        # not JSON, and jq or a browser refuses the whole file); one write per line.
        line = json.dumps(finite_or_none(record), sort_keys=True, allow_nan=False) + "\n"
        self._jsonl.write(line)
        if split == "train":
            self._csv.writerow([record.get(c, "") for c in CSV_COLUMNS])
        if self._tb is not None:
            scalars = [(f"{split}/{name}", value) for name, value in tensorboard_scalars(record)]
            self._tb.write(step, scalars)  # type: ignore[arg-type]

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        if self._tb is not None:
            self._tb.close()


def format_duration(seconds: float) -> str:
    """Seconds -> "H:MM:SS" (or "M:SS" under an hour); "?" if unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """One status line on a stream (stderr by default): step, %, metrics, steps/s, ETA.

    On a terminal the line is redrawn in place with ``\\r``; otherwise (logs, CI) a new
    line is printed at most every ``log_interval_s`` seconds. The rate is measured from
    the first update, so compilation time does not distort it.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        log_interval_s: float = 10.0,
        width: int = 20,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_interval_s = log_interval_s
        self.width = width
        self._first: tuple[int, float] | None = None
        self._last_print = -math.inf
        self._line_len = 0

    def rate(self, step: int, now: float) -> float:
        """Steps per second since the first update (nan before two updates)."""
        if self._first is None or step <= self._first[0] or now <= self._first[1]:
            return math.nan
        return (step - self._first[0]) / (now - self._first[1])

    def line(self, step: int, metrics: Mapping[str, float], now: float) -> str:
        """The status text for ``step``."""
        frac = min(max(step / max(self.total, 1), 0.0), 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        parts = [f"[{bar}] {step}/{self.total} {100 * frac:3.0f}%"]
        for key in ("loss", "accuracy", "density"):
            if key in metrics and metrics[key] is not None:
                parts.append(f"{key[:4]} {metrics[key]:.4f}")
        rate = self.rate(step, now)
        eta = (self.total - step) / rate if rate > 0 else math.nan
        rate_text = f"{rate:.2f} it/s" if math.isfinite(rate) else "? it/s"
        parts.append(f"{rate_text} ETA {format_duration(eta)}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, float], force: bool = False) -> None:
        """Report ``step``'s metrics (host floats)."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        if not (self.tty or force) and now - self._last_print < self.log_interval_s:
            return
        self._last_print = now
        text = self.line(step, metrics, now)
        if self.tty:
            pad = max(self._line_len - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self._line_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line."""
        if self.tty and self._line_len:
            self.stream.write("\n")
            self.stream.flush()


class NullWriter:
    """The records of a process other than 0: nothing is written."""

    def write(self, record: Mapping[str, Any]) -> None:
        del record

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class NullProgress:
    """The progress line of a process other than 0: nothing is printed."""

    def update(self, step: int, metrics: Mapping[str, Any], force: bool = False) -> None:
        del step, metrics, force

    def close(self) -> None:
        pass
