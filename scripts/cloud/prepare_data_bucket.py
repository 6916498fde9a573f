"""Prepare LRA tasks with lra.prepare and upload them to a Cloud Storage bucket.

  python scripts/cloud/prepare_data_bucket.py --tasks=listops,image \
      --bucket=gs://my-bucket/lra_tfds [--create_bucket --location=us-central2]
  python scripts/cloud/prepare_data_bucket.py --tasks=retrieval --manual_dir=/data/lra_release \
      --bucket=gs://my-bucket/lra_tfds --dry_run          # print the commands, run none

The datasets are written in array_record format to --local_dir first, then copied with
``gcloud storage rsync`` (idempotent: a second run copies only what changed). They are
not written to gs:// directly: ArrayRecord opens files with POSIX I/O and does not
understand gs:// paths (google/array_record#120). Training machines copy the bucket
back to local disk (tpu_vm.py / gpu_node.py --data_bucket) or mount it with Cloud
Storage FUSE, and point ``config.task.data_dir`` at that directory.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cloud_common import CommandRunner, check_bucket_path  # noqa: E402

TASKS = ("listops", "text", "retrieval", "image", "pathfinder")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help=f"comma list of {', '.join(TASKS)}")
    parser.add_argument("--bucket", required=True, help="gs://bucket/path of the TFDS dir")
    parser.add_argument("--local_dir", default="/tmp/lra_tfds", help="where to prepare first")
    parser.add_argument("--manual_dir", default="", help="LRA release files (retrieval, release)")
    parser.add_argument("--create_bucket", action="store_true", help="create the bucket first")
    parser.add_argument("--location", default="", help="bucket location for --create_bucket")
    parser.add_argument("--project", default="", help="GCP project (default: gcloud's)")
    parser.add_argument(
        "--prepare_flag",
        action="append",
        default=[],
        help="extra lra.prepare flag, e.g. --prepare_flag=--num_workers=8 (repeatable)",
    )
    parser.add_argument("--dry_run", action="store_true", help="print commands, run none")
    args = parser.parse_args(argv)
    args.tasks = [t for t in args.tasks.replace(" ", "").split(",") if t]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown or not args.tasks:
        parser.error(f"--tasks: unknown {unknown or args.tasks!r}; choose from {TASKS}")
    args.bucket = check_bucket_path(args.bucket, "--bucket")
    if args.create_bucket and not args.location:
        parser.error("--location is required with --create_bucket")
    return args


def commands(args: argparse.Namespace) -> list[list[str]]:
    """Every command, in order."""
    project = [f"--project={args.project}"] if args.project else []
    out: list[list[str]] = []
    if args.create_bucket:
        bucket_root = "/".join(args.bucket.split("/")[:3])  # gs://name
        out.append(
            ["gcloud", "storage", "buckets", "create", bucket_root, f"--location={args.location}"]
            + project
        )
    for task in args.tasks:
        prepare = [sys.executable, "-m", "lra.prepare", f"--task={task}"]
        prepare.append(f"--data_dir={args.local_dir}")
        if args.manual_dir:
            prepare.append(f"--manual_dir={args.manual_dir}")
        out.append(prepare + list(args.prepare_flag))
    out.append(["gcloud", "storage", "rsync", "--recursive", args.local_dir, args.bucket] + project)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runner = CommandRunner(dry_run=args.dry_run)
    for command in commands(args):
        runner.run(command)


if __name__ == "__main__":
    main()
