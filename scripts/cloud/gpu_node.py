"""Install sbm-jax with CUDA JAX on a multi-GPU node and train there.

  # on the node itself (all its GPUs form one mesh; one process)
  python scripts/cloud/gpu_node.py all --config=configs/lra/listops.py:sbm \
      --data_dir=/data/tfds --output_dir=runs/listops
  # from a workstation, over ssh; data copied from a bucket to the node's disk
  python scripts/cloud/gpu_node.py all --host=me@gpu-node --config=... \
      --data_bucket=gs://my-bucket/lra_tfds
  # two nodes: run once per node with its rank; node 0 hosts the coordinator
  python scripts/cloud/gpu_node.py train --host=node0 --num_nodes=2 --node_rank=0 \
      --coordinator=node0:8476 --config=...
  python scripts/cloud/gpu_node.py train --host=node1 --num_nodes=2 --node_rank=1 \
      --coordinator=node0:8476 --config=...
  # print the commands without running any
  python scripts/cloud/gpu_node.py all ... --dry_run

Steps: ``setup`` (pip install -e '.[gpu]', list the GPUs JAX sees), ``train``
(scripts/train.py; with ``--num_nodes`` > 1 the SBM_COORDINATOR / SBM_NUM_PROCESSES /
SBM_PROCESS_ID variables read by sbm_jax.training.distributed), ``all`` = both.
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
STEPS = ("setup", "train", "all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=STEPS, help="what to do")
    parser.add_argument("--host", default="", help="ssh target; empty: this machine")
    parser.add_argument(
        "--repo_dir",
        default="",
        help="checkout on the node (default: here, or ~/sbm-jax over ssh)",
    )
    parser.add_argument("--config", default="", help="config for train, path.py:preset")
    parser.add_argument("--data_dir", default="", help="local TFDS data dir on the node")
    parser.add_argument("--data_bucket", default="", help="gs:// TFDS dir to copy to the node")
    parser.add_argument("--local_data_dir", default="/tmp/tfds", help="copy target on the node")
    parser.add_argument("--output_dir", default="", help="train --output_dir (default runs/...)")
    parser.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes in the job")
    parser.add_argument("--node_rank", type=int, default=0, help="this node's index")
    parser.add_argument("--coordinator", default="", help="host:port of node 0 (multi-node)")
    parser.add_argument(
        "--override", action="append", default=[], help="extra train flag (repeatable)"
    )
    parser.add_argument("--dry_run", action="store_true", help="print commands, run none")
    args = parser.parse_args(argv)
    if args.step in ("train", "all") and not args.config:
        parser.error(f"--config is required for step {args.step!r}")
    if args.data_dir and args.data_bucket:
        parser.error("give --data_dir or --data_bucket, not both")
    if args.data_bucket:
        args.data_bucket = check_bucket_path(args.data_bucket, "--data_bucket")
    if args.num_nodes < 1:
        parser.error(f"--num_nodes must be >= 1, got {args.num_nodes}")
    if not 0 <= args.node_rank < args.num_nodes:
        parser.error(
            f"--node_rank={args.node_rank} is out of range for --num_nodes={args.num_nodes}"
        )
    if args.num_nodes > 1 and not args.coordinator:
        parser.error("--coordinator (host:port of node 0) is required when --num_nodes > 1")
    if not args.repo_dir:
        args.repo_dir = DEFAULT_REPO_DIR if args.host else REPO_ROOT
    return args


def _on_node(args: argparse.Namespace, script: str) -> list[str]:
    script = f"cd {args.repo_dir} && {script}"
    if args.host:
        return ["ssh", args.host, script]
    return ["bash", "-c", script]


def commands(args: argparse.Namespace) -> list[list[str]]:
    """Every command of ``args.step``, in order."""
    steps = ("setup", "train") if args.step == "all" else (args.step,)
    out: list[list[str]] = []
    for step in steps:
        if step == "setup":
            out.append(_on_node(args, f"python3 -m pip install -e {shlex.quote('.[gpu]')}"))
            out.append(
                _on_node(args, "python3 -c 'import jax; print(jax.device_count(), jax.devices())'")
            )
        else:
            env = []
            if args.gpus:
                env.append(f"CUDA_VISIBLE_DEVICES={args.gpus}")
            if args.num_nodes > 1:
                env += [
                    f"SBM_COORDINATOR={args.coordinator}",
                    f"SBM_NUM_PROCESSES={args.num_nodes}",
                    f"SBM_PROCESS_ID={args.node_rank}",
                ]
            data_dir = args.data_dir or None
            script = ""
            if args.data_bucket:
                data_dir = args.local_data_dir
                script = stage_data_command(args.data_bucket, data_dir) + " && "
            train = train_command(args.config, data_dir, args.output_dir or None, args.override)
            script += " ".join([*env, train])
            out.append(_on_node(args, script))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runner = CommandRunner(dry_run=args.dry_run)
    for command in commands(args):
        runner.run(command)


if __name__ == "__main__":
    main()
