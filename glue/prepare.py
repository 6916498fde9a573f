"""Prepare GLUE (and optionally a TFDS pretraining corpus) once, for offline training.

  python -m glue.prepare --tasks=sst2,qqp,mnli,qnli [--data_dir=~/tensorflow_datasets]
  python -m glue.prepare --tasks= --corpus=wikipedia/20230601.en   # the MLM corpus only

Builds each TFDS dataset (``glue/<task>``, needs network access once) in array_record
format under ``--data_dir``, which is what the trainer reads with ``tfds.data_source``
(no TensorFlow at training time). After this, train with ``data.tfds_download=False``
(the paper presets' fine-tuning also works offline then) and
``--config.data.tfds_data_dir=<data_dir>`` if it is not the TFDS default.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

from glue.data import GLUE_TASKS, get_task_spec

_TASKS = flags.DEFINE_list("tasks", list(GLUE_TASKS), f"GLUE tasks of {sorted(GLUE_TASKS)}.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory (default: TFDS's).")
_CORPUS = flags.DEFINE_string(
    "corpus",
    "",
    "Also prepare this TFDS text builder (data.tfds_name), e.g. wikipedia/20230601.en.",
)


def prepare(
    tasks: Sequence[str],
    data_dir: str | None = None,
    corpus: str = "",
    builder_fn: Callable[..., Any] | None = None,
) -> dict[str, str]:
    """Build ``glue/<task>`` for each task (and ``corpus``) as array_record.

    Returns ``{dataset name: its directory}``. ``builder_fn`` (default ``tfds.builder``)
    is ``(name, data_dir=...) -> builder``.

    Raises:
      ValueError naming ``--tasks`` for an unknown task.
    """
    for task in tasks:
        try:
            get_task_spec(task)
        except ValueError:
            raise ValueError(
                f"--tasks: {task!r} is not a GLUE task; choose from {sorted(GLUE_TASKS)}"
            ) from None
    if builder_fn is None:
        import tensorflow_datasets as tfds
        import tensorflow_datasets.text  # noqa: F401  (registers glue and the text builders)

        builder_fn = tfds.builder
    data_dir = os.path.expanduser(data_dir) if data_dir else None
    names = [get_task_spec(t).tfds_name for t in tasks] + ([corpus] if corpus else [])
    out = {}
    for name in names:
        builder = builder_fn(name, data_dir=data_dir)
        builder.download_and_prepare(file_format="array_record")
        out[name] = str(builder.data_dir)
        print(f"prepared {name} -> {builder.data_dir}", flush=True)
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    tasks = [t for t in _TASKS.value if t]
    try:
        prepare(tasks, _DATA_DIR.value, _CORPUS.value)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
