"""Create a Cloud TPU VM, install sbm-jax on every worker, train, and delete it.

  # single host (v4-8: one worker, 4 chips)
  python scripts/cloud/tpu_vm.py all --name=sbm-v4 --zone=us-central2-b \
      --accelerator_type=v4-8 --config=configs/lra/listops.py:sbm \
      --data_bucket=gs://my-bucket/lra_tfds --output_dir=/tmp/runs/listops
  # multi-host (v4-32: 4 workers): the same, every command goes to --worker=all
  python scripts/cloud/tpu_vm.py all --name=sbm-v4-32 --zone=us-central2-b \
      --accelerator_type=v4-32 --config=configs/lra/listops.py:sbm --data_bucket=...
  # print the commands without running any
  python scripts/cloud/tpu_vm.py all ... --dry_run

Steps: ``create`` (gcloud compute tpus tpu-vm create), ``setup`` (copy this checkout to
every worker, pip install '.[tpu]'), ``train`` (copy the prepared data from the bucket
to each worker's disk, run scripts/train.py on all workers at once), ``delete``;
``all`` runs create, setup, train. Every ssh/scp targets ``--worker`` (default ``all``:
on a multi-host slice each worker runs one JAX process, and JAX finds the others
through the TPU environment).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cloud_common import (  # noqa: E402
    DEFAULT_REPO_DIR,
    CommandRunner,
    check_bucket_path,
    stage_data_command,
    train_command,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a worker needs from the checkout (no runs/, caches or virtual environments).
SOURCES = ("pyproject.toml", "README.md", "sbm_jax", "lra", "glue", "configs", "scripts")
STEPS = ("create", "setup", "train", "delete", "all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=STEPS, help="what to do")
    parser.add_argument("--name", required=True, help="TPU VM name")
    parser.add_argument("--zone", required=True, help="zone, e.g. us-central2-b")
    parser.add_argument("--project", default="", help="GCP project (default: gcloud's)")
    parser.add_argument("--accelerator_type", default="v4-8", help="e.g. v4-8, v4-32, v5p-16")
    parser.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU VM runtime")
    parser.add_argument("--spot", action="store_true", help="create a Spot (preemptible) VM")
    parser.add_argument(
        "--worker", default="all", help="'all' (every host: multi-host) or one worker index"
    )
    parser.add_argument("--config", default="", help="config for train, path.py:preset")
    parser.add_argument(
        "--data_bucket", default="", help="gs:// TFDS dir made by prepare_data_bucket.py"
    )
    parser.add_argument(
        "--local_data_dir", default="/tmp/tfds", help="where each worker keeps its data copy"
    )
    parser.add_argument("--output_dir", default="", help="train --output_dir (default runs/...)")
    parser.add_argument("--repo_dir", default=DEFAULT_REPO_DIR, help="checkout dir on workers")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra train flag, e.g. --override=--config.train.num_steps=100 (repeatable)",
    )
    parser.add_argument("--dry_run", action="store_true", help="print commands, run none")
    args = parser.parse_args(argv)
    if args.worker != "all" and not args.worker.isdigit():
        parser.error(f"--worker must be 'all' or a worker index, got {args.worker!r}")
    if args.step in ("train", "all") and not args.config:
        parser.error(f"--config is required for step {args.step!r}")
    if args.data_bucket:
        args.data_bucket = check_bucket_path(args.data_bucket, "--data_bucket")
    return args


def _gcloud(args: argparse.Namespace, *parts: str) -> list[str]:
    command = ["gcloud", "compute", "tpus", "tpu-vm", *parts, f"--zone={args.zone}"]
    if args.project:
        command.append(f"--project={args.project}")
    return command


def _ssh(args: argparse.Namespace, remote: str) -> list[str]:
    return _gcloud(args, "ssh", args.name, f"--worker={args.worker}", f"--command={remote}")


def commands(args: argparse.Namespace) -> list[list[str]]:
    """Every command of ``args.step``, in order."""
    steps = ("create", "setup", "train") if args.step == "all" else (args.step,)
    repo = args.repo_dir
    out: list[list[str]] = []
    for step in steps:
        if step == "create":
            create = _gcloud(
                args,
                "create",
                args.name,
                f"--accelerator-type={args.accelerator_type}",
                f"--version={args.version}",
            )
            if args.spot:
                create.append("--spot")
            out.append(create)
        elif step == "setup":
            out.append(_ssh(args, f"mkdir -p {repo}"))
            out.append(
                _gcloud(
                    args,
                    "scp",
                    "--recurse",
                    *[os.path.join(REPO_ROOT, s) for s in SOURCES],
                    f"{args.name}:{repo}",
                    f"--worker={args.worker}",
                )
            )
            out.append(
                _ssh(args, f"cd {repo} && python3 -m pip install -e {shlex.quote('.[tpu]')}")
            )
            out.append(
                _ssh(args, "python3 -c 'import jax; print(jax.process_count(), jax.devices())'")
            )
        elif step == "train":
            data_dir = None
            prefix = f"cd {repo} && "
            if args.data_bucket:
                data_dir = args.local_data_dir
                prefix += stage_data_command(args.data_bucket, data_dir) + " && "
            train = train_command(args.config, data_dir, args.output_dir or None, args.override)
            out.append(_ssh(args, prefix + train))
        elif step == "delete":
            out.append(_gcloud(args, "delete", args.name, "--quiet"))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runner = CommandRunner(dry_run=args.dry_run)
    for command in commands(args):
        runner.run(command)


if __name__ == "__main__":
    main()
