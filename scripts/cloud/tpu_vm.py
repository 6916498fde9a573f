"""Create a Cloud TPU VM, install sbm-jax on every worker and start training there,
detached, with checkpoints and metrics in a gs:// bucket.

  # single host (v4-8: one worker, 4 chips)
  python scripts/cloud/tpu_vm.py all --name=sbm-v4 --zone=us-central2-b \
      --accelerator_type=v4-8 --config=configs/lra/listops.py:sbm \
      --data_bucket=gs://my-bucket/lra_tfds --output_dir=gs://my-bucket/runs/listops
  # multi-host (v4-32: 4 workers): the same; every worker runs one JAX process and all
  # of them share the run's checkpoints through the bucket
  python scripts/cloud/tpu_vm.py all --name=sbm-v4-32 --zone=us-central2-b \
      --accelerator_type=v4-32 --config=configs/lra/listops.py:sbm --data_bucket=... \
      --output_dir=gs://my-bucket/runs/listops_v4_32 --spot
  python scripts/cloud/tpu_vm.py logs --name=sbm-v4 --zone=us-central2-b \
      --output_dir=gs://my-bucket/runs/listops --follow       # the training log
  python scripts/cloud/tpu_vm.py fetch --name=sbm-v4 --zone=us-central2-b \
      --output_dir=gs://my-bucket/runs/listops                 # metrics to runs/listops
  python scripts/cloud/tpu_vm.py delete --name=sbm-v4 --zone=us-central2-b \
      --output_dir=gs://my-bucket/runs/listops                 # after the run
  # print the commands without running any
  python scripts/cloud/tpu_vm.py all ... --dry_run

Steps: ``create`` (gcloud compute tpus tpu-vm create), ``setup`` (copy this checkout to
every worker, make a Python 3.11 venv there and pip install '.[lra,tpu]' at the versions
in constraints.txt, install Cloud Storage FUSE), ``train`` (start
scripts/cloud/train_job.sh on every worker with nohup and return: it copies the data from
--data_bucket, mounts the --output_dir bucket, runs scripts/train.py with its log in
~/sbm-logs/<run>.log, and copies the metrics to --output_dir), ``all`` = create, setup,
train. Then: ``logs`` (tail the log of --worker, 0 by default), ``stop`` (SIGTERM to the
trainers: they save and exit), ``fetch`` (copy the run's metrics from the bucket here),
``delete`` (refuses while a trainer runs, copies the logs to the bucket, then deletes the
VM; ``--force`` skips both). A preempted Spot VM: ``delete --force``, then ``all`` again
with the same --output_dir: the trainer resumes from the newest checkpoint in the bucket.
Every ssh/scp targets ``--worker`` (default ``all``: on a multi-host slice each worker
runs one JAX process, and JAX finds the others through the TPU environment).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cloud_common import (  # noqa: E402
    DEFAULT_REPO_DIR,
    DEFAULT_VENV,
    GCSFUSE_INSTALL,
    PYTHON_VERSION,
    REPO_ROOT,
    SOURCES,
    CommandRunner,
    check_bucket_path,
    detached_job_command,
    log_path,
    not_running_check,
    run_name,
    shell_path,
    split_bucket_path,
    stop_command,
    tail_command,
    train_command,
    venv_setup_command,
)

STEPS = ("create", "setup", "train", "all", "logs", "stop", "fetch", "delete")
# Writing to the bucket needs a storage write scope; what the VM may then do is decided
# by its service account's IAM roles.
SCOPES = "https://www.googleapis.com/auth/cloud-platform"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
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
    parser.add_argument(
        "--output_dir",
        default="",
        help="gs://bucket/path of the run, shared by all workers (train, logs, fetch, delete)",
    )
    parser.add_argument("--repo_dir", default=DEFAULT_REPO_DIR, help="checkout dir on workers")
    parser.add_argument("--venv", default=DEFAULT_VENV, help="virtual environment on workers")
    parser.add_argument("--python", default=PYTHON_VERSION, help="Python version of the venv")
    parser.add_argument(
        "--extras", default="lra", help="extras installed beside [tpu], e.g. lra,glue"
    )
    parser.add_argument("--sync_every", type=int, default=120, help="seconds between metric copies")
    parser.add_argument("--fetch_dir", default="", help="fetch target (default runs/<run>)")
    parser.add_argument("--follow", action="store_true", help="logs: keep following (tail -F)")
    parser.add_argument("--force", action="store_true", help="delete without checks or copies")
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
    needs_output = ("train", "all", "logs", "stop", "fetch") + (() if args.force else ("delete",))
    if args.step in needs_output and not args.output_dir:
        parser.error(
            f"--output_dir=gs://bucket/path is required for step {args.step!r}"
            + (" (or --force to delete without copying the logs)" if args.step == "delete" else "")
        )
    if args.output_dir:
        args.output_dir = check_bucket_path(args.output_dir, "--output_dir")
        if not split_bucket_path(args.output_dir)[1]:
            parser.error(f"--output_dir needs a path inside the bucket, got {args.output_dir!r}")
    if args.data_bucket:
        args.data_bucket = check_bucket_path(args.data_bucket, "--data_bucket")
    if args.sync_every < 1:
        parser.error(f"--sync_every must be >= 1, got {args.sync_every}")
    return args


def _gcloud(args: argparse.Namespace, *parts: str) -> list[str]:
    command = ["gcloud", "compute", "tpus", "tpu-vm", *parts, f"--zone={args.zone}"]
    if args.project:
        command.append(f"--project={args.project}")
    return command


def _ssh(args: argparse.Namespace, remote: str, worker: str | None = None) -> list[str]:
    worker = worker or args.worker
    return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={remote}")


def _in_repo(args: argparse.Namespace, script: str) -> str:
    return f"cd {shell_path(args.repo_dir)} && {script}"


def run_paths(args: argparse.Namespace) -> dict[str, str]:
    """Where the run lives: its name, the bucket mount and the workers' local run dir."""
    bucket, path = split_bucket_path(args.output_dir)
    return {
        "name": run_name(args.config, args.output_dir),
        "mount": f"~/gcs/{bucket}",
        "run_dir": f"runs/gcs/{bucket}/{path}",  # relative to the checkout
    }


def commands(args: argparse.Namespace) -> list[list[str]]:
    """Every command of ``args.step``, in order."""
    steps = ("create", "setup", "train") if args.step == "all" else (args.step,)
    repo = args.repo_dir
    project = [f"--project={args.project}"] if args.project else []
    out: list[list[str]] = []
    for step in steps:
        if step == "create":
            create = _gcloud(
                args,
                "create",
                args.name,
                f"--accelerator-type={args.accelerator_type}",
                f"--version={args.version}",
                f"--scopes={SCOPES}",
            )
            if args.spot:
                create.append("--spot")
            out.append(create)
        elif step == "setup":
            out.append(_ssh(args, f"mkdir -p {shell_path(repo)}"))
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
            extras = ",".join([*filter(None, args.extras.split(",")), "tpu"])
            out.append(
                _ssh(
                    args,
                    _in_repo(args, venv_setup_command(args.venv, extras, args.python))
                    + " && "
                    + GCSFUSE_INSTALL,
                )
            )
            check = "import jax; print(jax.process_index(), jax.process_count(), jax.devices())"
            out.append(_ssh(args, f"{shell_path(args.venv)}/bin/python -c {shlex.quote(check)}"))
        elif step == "train":
            paths = run_paths(args)
            env = {
                "SBM_JOB_BUCKET_DIR": args.output_dir,
                "SBM_JOB_RUN_DIR": paths["run_dir"],
                "SBM_JOB_MOUNT": paths["mount"],
                "SBM_JOB_SYNC_EVERY": str(args.sync_every),
            }
            data_dir = None
            if args.data_bucket:
                data_dir = args.local_data_dir
                env["SBM_JOB_DATA_BUCKET"] = args.data_bucket
                env["SBM_JOB_DATA_DIR"] = data_dir
            train = train_command(
                args.config,
                data_dir,
                paths["run_dir"],
                args.override,
                python=f"{args.venv}/bin/python",
            )
            out.append(_ssh(args, _in_repo(args, detached_job_command(paths["name"], env, train))))
        elif step == "logs":
            worker = args.worker if args.worker != "all" else "0"
            name = run_paths(args)["name"]
            out.append(_ssh(args, tail_command(name, args.follow), worker=worker))
        elif step == "stop":
            out.append(_ssh(args, stop_command(run_paths(args)["name"])))
        elif step == "fetch":
            name = run_paths(args)["name"]
            target = args.fetch_dir or os.path.join("runs", name)
            out.append(
                [
                    "gcloud",
                    "storage",
                    "rsync",
                    "--recursive",
                    "--exclude=^(checkpoints|nonfinite)/",
                    args.output_dir,
                    target,
                    *project,
                ]
            )
        elif step == "delete":
            if not args.force:
                name = run_paths(args)["name"]
                copy_log = (
                    f"gcloud storage cp {shell_path(log_path(name))} "
                    f'{shlex.quote(args.output_dir + "/logs/")}"$(hostname).log"'
                )
                out.append(_ssh(args, f"{not_running_check(name)}; {copy_log}"))
            out.append(_gcloud(args, "delete", args.name, "--quiet"))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runner = CommandRunner(dry_run=args.dry_run)
    for command in commands(args):
        runner.run(command)


if __name__ == "__main__":
    main()
