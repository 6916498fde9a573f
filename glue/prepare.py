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

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from glue.data import GLUE_TASKS, get_task_spec


class DownloadFailed(RuntimeError):
    """A dataset's download failed (offline, say): the message names the dataset."""


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
      ValueError naming ``--tasks`` for an unknown task; DownloadFailed naming the
      dataset whose download failed.
    """
    if not tasks and not corpus:
        raise ValueError("--tasks is empty and there is no --corpus: nothing to prepare")
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
    import requests  # what TFDS downloads with

    # Every builder first, so that a misspelt --corpus fails before any download.
    builders = {}
    for name in names:
        try:
            builders[name] = builder_fn(name, data_dir=data_dir)
        except ValueError as e:  # TFDS's DatasetNotFoundError is one
            flag = "--corpus" if name == corpus else "--tasks"
            raise ValueError(f"{flag}: no TFDS builder {name!r} ({_first_line(e)})") from None
    for name, builder in builders.items():
        try:
            builder.download_and_prepare(file_format="array_record")
        except requests.exceptions.RequestException as e:
            detail = " ".join(str(e).split())
            detail = detail if len(detail) <= 200 else detail[:200] + "..."
            raise DownloadFailed(
                f"could not download {name} ({type(e).__name__}: {detail}); preparing it "
                "needs network access once (or run glue.prepare where there is some and "
                "copy the TFDS data dir)"
            ) from e
        out[name] = str(builder.data_dir)
        print(f"prepared {name} -> {builder.data_dir}", flush=True)
    return out


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", default=",".join(GLUE_TASKS), help=f"comma list of {sorted(GLUE_TASKS)}"
    )
    parser.add_argument("--data_dir", default=None, help="TFDS data directory (default: TFDS's)")
    parser.add_argument(
        "--corpus", default="", help="also this TFDS text builder, e.g. wikipedia/20230601.en"
    )
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    try:
        prepare(tasks, args.data_dir, args.corpus)
    except (ValueError, DownloadFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
