"""Set up sbm-jax with CUDA JAX on one or more GPU nodes and train there, detached.

  # on this machine (all its GPUs form one mesh; one process)
  python scripts/cloud/gpu_node.py all --config=configs/lra/listops.py:sbm \
      --data_dir=/data/tfds --output_dir=runs/listops
  # on a node over ssh; the checkout is copied there, data copied from a bucket
  python scripts/cloud/gpu_node.py all --hosts=me@gpu-node --config=... \
      --data_bucket=gs://my-bucket/lra_tfds --output_dir=runs/listops
  # two nodes: one process each, started by this script; node 0 hosts the coordinator.
  # --output_dir must be on a filesystem both nodes share (NFS, a gcsfuse mount).
  python scripts/cloud/gpu_node.py all --hosts=me@node0,me@node1 --config=... \
      --output_dir=/shared/runs/listops
  python scripts/cloud/gpu_node.py logs --hosts=me@node0,me@node1 --output_dir=... --follow
  python scripts/cloud/gpu_node.py stop --hosts=me@node0,me@node1 --output_dir=...
  # print the commands without running any
  python scripts/cloud/gpu_node.py all ... --dry_run

Steps: ``setup`` (on every host: copy this checkout with rsync, unless training here;
make a Python 3.11 venv; pip install '.[lra,gpu]' at the versions in constraints.txt;
list the GPUs JAX sees), ``train`` (start scripts/cloud/train_job.sh running
scripts/train.py on every host with nohup, node 0 first, and return; with several hosts
each gets SBM_COORDINATOR / SBM_NUM_PROCESSES / SBM_PROCESS_ID, read by
sbm_jax.training.distributed; the log is ~/sbm-logs/<run>.log on each host), ``all`` =
setup, train; ``logs`` (tail one host's log: --node, default 0; --follow keeps
following), ``stop`` (SIGTERM to every trainer: they save the latest checkpoint and
exit). After a preemption or a stop, ``train`` again with the same --output_dir resumes
from the newest checkpoint.
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
    PYTHON_VERSION,
    REPO_ROOT,
    SOURCES,
    CommandRunner,
    check_bucket_path,
    detached_job_command,
    run_name,
    shell_path,
    stop_command,
    tail_command,
    train_command,
    venv_setup_command,
)

STEPS = ("setup", "train", "all", "logs", "stop")
DEFAULT_PORT = 8476


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("step", choices=STEPS, help="what to do")
    parser.add_argument(
        "--hosts",
        "--host",
        default="",
        help="comma list of ssh targets, node 0 first; empty: this machine",
    )
    parser.add_argument(
        "--repo_dir",
        default="",
        help=f"checkout on the nodes (default: this one here, ~/{DEFAULT_REPO_DIR} over ssh)",
    )
    parser.add_argument(
        "--venv", default="", help=f"venv (default: .venv in the checkout here, {DEFAULT_VENV})"
    )
    parser.add_argument("--python", default=PYTHON_VERSION, help="Python version of the venv")
    parser.add_argument(
        "--extras", default="lra", help="extras installed beside [gpu], e.g. lra,glue"
    )
    parser.add_argument("--config", default="", help="config for train, path.py:preset")
    parser.add_argument("--data_dir", default="", help="local TFDS data dir on the nodes")
    parser.add_argument("--data_bucket", default="", help="gs:// TFDS dir to copy to the nodes")
    parser.add_argument("--local_data_dir", default="/tmp/tfds", help="copy target on the node")
    parser.add_argument(
        "--output_dir",
        default="",
        help="train --output_dir (shared by all nodes when there are several)",
    )
    parser.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3")
    parser.add_argument(
        "--coordinator",
        default="",
        help=f"host:port of node 0 for multi-node runs (default: node 0's host:{DEFAULT_PORT})",
    )
    parser.add_argument("--node", type=int, default=0, help="logs: which node's log")
    parser.add_argument("--follow", action="store_true", help="logs: keep following (tail -F)")
    parser.add_argument(
        "--override", action="append", default=[], help="extra train flag (repeatable)"
    )
    parser.add_argument("--dry_run", action="store_true", help="print commands, run none")
    args = parser.parse_args(argv)
    args.hosts = [h for h in args.hosts.replace(" ", "").split(",") if h]
    if args.step in ("train", "all") and not args.config:
        parser.error(f"--config is required for step {args.step!r}")
    if args.data_dir and args.data_bucket:
        parser.error("give --data_dir or --data_bucket, not both")
    if args.data_bucket:
        args.data_bucket = check_bucket_path(args.data_bucket, "--data_bucket")
    if len(args.hosts) > 1 and not args.output_dir:
        parser.error(
            f"--output_dir is required with {len(args.hosts)} hosts: a directory every "
            "node sees (NFS, a gcsfuse mount), where the checkpoints of all processes go"
        )
    if args.step in ("logs", "stop") and not (args.output_dir or args.config):
        parser.error(f"step {args.step!r} needs the --output_dir (or --config) of the run")
    if not 0 <= args.node < max(len(args.hosts), 1):
        parser.error(f"--node={args.node} is out of range for {len(args.hosts)} hosts")
    if len(args.hosts) > 1 and not args.coordinator:
        args.coordinator = f"{args.hosts[0].rsplit('@', 1)[-1]}:{DEFAULT_PORT}"
    if args.coordinator:
        # Checked here, not only by the trainer on every node once the job has started.
        host, sep, port = args.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(
                f"--coordinator must be host:port (e.g. 10.0.0.2:8476), got {args.coordinator!r}"
            )
    if not args.repo_dir:
        args.repo_dir = DEFAULT_REPO_DIR if args.hosts else REPO_ROOT
    if not args.venv:
        args.venv = DEFAULT_VENV if args.hosts else os.path.join(args.repo_dir, ".venv")
    return args


def _on(args: argparse.Namespace, host: str, script: str) -> list[str]:
    """``script`` run in the checkout on ``host`` (ssh), or here (bash) when empty."""
    script = f"cd {shell_path(args.repo_dir)} && {script}"
    if host:
        return ["ssh", host, script]
    return ["bash", "-c", script]


def commands(args: argparse.Namespace) -> list[list[str]]:
    """Every command of ``args.step``, in order."""
    steps = ("setup", "train") if args.step == "all" else (args.step,)
    hosts = args.hosts or [""]
    name = run_name(args.config, args.output_dir)
    out: list[list[str]] = []
    for step in steps:
        if step == "setup":
            extras = ",".join([*filter(None, args.extras.split(",")), "gpu"])
            check = "import jax; print(jax.local_device_count(), jax.local_devices())"
            for host in hosts:
                if host:
                    out.append(["ssh", host, f"mkdir -p {shell_path(args.repo_dir)}"])
                    out.append(
                        [
                            "rsync",
                            "-az",
                            "--exclude=__pycache__",
                            *[os.path.join(REPO_ROOT, s) for s in SOURCES],
                            f"{host}:{args.repo_dir}/",
                        ]
                    )
                out.append(_on(args, host, venv_setup_command(args.venv, extras, args.python)))
                out.append(
                    _on(args, host, f"{shell_path(args.venv)}/bin/python -c {shlex.quote(check)}")
                )
        elif step == "train":
            data_dir = args.data_dir or None
            base_env = {}
            if args.data_bucket:
                data_dir = args.local_data_dir
                base_env = {"SBM_JOB_DATA_BUCKET": args.data_bucket, "SBM_JOB_DATA_DIR": data_dir}
            train = train_command(
                args.config,
                data_dir,
                args.output_dir or None,
                args.override,
                python=f"{args.venv}/bin/python",
            )
            for rank, host in enumerate(hosts):  # node 0 (the coordinator) first
                env = dict(base_env)
                if args.gpus:
                    env["CUDA_VISIBLE_DEVICES"] = args.gpus
                if len(hosts) > 1:
                    env["SBM_COORDINATOR"] = args.coordinator
                    env["SBM_NUM_PROCESSES"] = str(len(hosts))
                    env["SBM_PROCESS_ID"] = str(rank)
                out.append(_on(args, host, detached_job_command(name, env, train)))
        elif step == "logs":
            out.append(_on(args, hosts[args.node], tail_command(name, args.follow)))
        elif step == "stop":
            for host in hosts:
                out.append(_on(args, host, stop_command(name)))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runner = CommandRunner(dry_run=args.dry_run)
    for command in commands(args):
        runner.run(command)


if __name__ == "__main__":
    main()
