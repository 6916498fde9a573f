"""Host-side metric output: JSONL and CSV writers and a plain-text progress bar."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from collections.abc import Mapping
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


class MetricsWriter:
    """Appends one JSON record per line to ``metrics.jsonl`` and training rows to
    ``metrics.csv`` (columns step, loss, accuracy, density; density empty when the
    mechanism sows none). Appending lets a restarted run continue the same files."""

    def __init__(self, output_dir: str) -> None:
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl")
        self.csv_path = os.path.join(output_dir, "metrics.csv")
        new_csv = not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
        self._csv_file = open(self.csv_path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._csv = csv.writer(self._csv_file)
        if new_csv:
            self._csv.writerow(CSV_COLUMNS)

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record; ``split`` "train" (default) rows also go to the CSV."""
        record = to_python(record)
        self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        if record.get("split", "train") == "train":
            self._csv.writerow([record.get(c, "") for c in CSV_COLUMNS])

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


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
