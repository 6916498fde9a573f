"""Prepares one LRA task as a TFDS array_record dataset.

  python -m lra.prepare --task=listops --data_dir=~/tensorflow_datasets
  python -m lra.prepare --task=listops --num_train=2000 --num_validation=200 \
      --num_test=200 --min_length=128 --max_length=512          # reduced scale
  python -m lra.prepare --task=pathfinder --difficulty=hard --num_workers=8
  python -m lra.prepare --task=retrieval --manual_dir=/data/lra_release

Idempotent: a dataset already prepared is left as is (TFDS writes into a temporary
directory and renames it at the end, so an interrupted run leaves nothing half-done;
running again starts that dataset over).  Prints the config name to pass to
`lra.input_pipeline` and the size on disk.

text and image download TFDS' imdb_reviews and cifar10 from their source hosts
(network access needed; --catalog_data_dir points at a copy already prepared). Offline,
the download fails after TFDS's retries with one error line and exit code 2.
"""

from __future__ import annotations

import os
import sys
import time

import tensorflow_datasets as tfds
from absl import app, flags

from lra import builders, tasks

FLAGS = flags.FLAGS
flags.DEFINE_enum("task", None, sorted(tasks.TASKS), "LRA task to prepare.")
flags.DEFINE_string("data_dir", None, "TFDS data dir (default: TFDS's, ~/tensorflow_datasets).")
flags.DEFINE_string("manual_dir", None, "Where the LRA release files are (release sources).")
flags.DEFINE_string(
    "catalog_data_dir", None, "Where imdb_reviews / cifar10 are prepared (default: data_dir)."
)
flags.DEFINE_enum(
    "source", None, ["generated", "release"], "listops / pathfinder: generator or release files."
)
flags.DEFINE_enum("difficulty", "hard", ["easy", "intermediate", "hard"], "pathfinder difficulty.")
flags.DEFINE_integer("num_train", None, "Generated tasks: training examples.")
flags.DEFINE_integer("num_validation", None, "Generated tasks: validation examples.")
flags.DEFINE_integer("num_test", None, "Generated tasks: test examples.")
flags.DEFINE_integer("min_length", None, "listops: tokens > min_length (default 500).")
flags.DEFINE_integer("max_length", None, "listops: tokens < max_length; text/retrieval: cut.")
flags.DEFINE_integer("seed", None, "Generated tasks: seed.")
flags.DEFINE_integer("num_workers", 1, "pathfinder generator: processes.")


def _options(task: str) -> dict:
    opts = {}
    given = {
        "num_train": FLAGS.num_train,
        "num_validation": FLAGS.num_validation,
        "num_test": FLAGS.num_test,
        "min_length": FLAGS.min_length,
        "max_length": FLAGS.max_length,
        "seed": FLAGS.seed,
    }
    allowed = {
        "listops": {"num_train", "num_validation", "num_test", "min_length", "max_length", "seed"},
        "pathfinder": {"num_train", "num_validation", "num_test", "seed"},
        "text": {"max_length"},
        "retrieval": {"max_length"},
        "image": set(),
    }[task]
    for key, value in given.items():
        if value is None:
            continue
        if key not in allowed:
            raise app.UsageError(f"--{key} does not apply to --task={task}")
        opts[key] = value
    if task == "listops" and "max_length" in opts and "min_length" not in opts:
        # Keep the reference ratio 500 / 2000 when only the cap is reduced.
        opts["min_length"] = opts["max_length"] // 4
    if task in ("listops", "pathfinder"):
        opts["source"] = FLAGS.source or "generated"
        if opts["source"] == "release" and set(opts) - {"source"}:
            raise app.UsageError("size options only apply to --source=generated")
    elif FLAGS.source is not None:
        raise app.UsageError(f"--source does not apply to --task={task}")
    if task == "pathfinder":
        opts["difficulty"] = FLAGS.difficulty
    return opts


def _dir_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def prepare(argv_task: str) -> str:
    task = argv_task
    config = builders.make_config(task, **_options(task))
    kwargs = {"data_dir": FLAGS.data_dir}
    if task in ("text", "image"):
        kwargs["catalog_data_dir"] = FLAGS.catalog_data_dir or FLAGS.data_dir
    if task == "pathfinder":
        kwargs["num_workers"] = FLAGS.num_workers
    builder = builders.make_builder(task, config, **kwargs)
    tfds.display_progress_bar(True)
    start = time.time()
    manual = os.path.expanduser(FLAGS.manual_dir) if FLAGS.manual_dir else None
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=manual),
    )
    seconds = time.time() - start
    splits = {name: info.num_examples for name, info in builder.info.splits.items()}
    print(f"task: {task}")
    print(f"config: {config.name if config is not None else '(none)'}")
    print(f"dataset dir: {builder.data_dir}")
    print(f"splits: {splits}")
    print(f"size on disk: {_dir_size(os.fspath(builder.data_dir)) / 2**20:.2f} MiB")
    print(f"seconds: {seconds:.1f}")
    return os.fspath(builder.data_dir)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import requests  # TFDS downloads with it

    try:
        prepare(FLAGS.task)
    except (builders.MissingFilesError, builders.MalformedFileError, ValueError) as e:
        # Bad input (missing or malformed release files, sizes that cannot be met): one
        # line naming the file and line or the option, exit 2.
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except requests.exceptions.RequestException as e:
        # Only text and image download (the other tasks are generated or read from the
        # release files): offline, TFDS gives up after its retries with a long traceback.
        print(f"error: {download_failure(FLAGS.task, e)}", file=sys.stderr)
        sys.exit(2)


def download_failure(task: str, error: BaseException) -> str:
    """One line for a failed download of ``task``'s TFDS source dataset."""
    catalog = {"text": "imdb_reviews", "image": "cifar10"}.get(task, "its source data")
    detail = " ".join(str(error).split())
    if len(detail) > 200:
        detail = detail[:200] + "..."
    return (
        f"--task={task}: could not download TFDS {catalog!r} ({type(error).__name__}: "
        f"{detail}). Preparing {task} needs network access to its source host, or "
        f"--catalog_data_dir=DIR where {catalog} is already prepared."
    )


def console_main() -> None:
    """The ``sbm-lra-prepare`` console command (same flags as ``python -m lra.prepare``)."""
    flags.mark_flag_as_required("task")
    app.run(main)


if __name__ == "__main__":
    console_main()
