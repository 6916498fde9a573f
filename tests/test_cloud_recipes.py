"""The cloud launch scripts' dry-run mode: the printed commands carry the right worker
flags, config, data_dir and environment, and nothing is executed."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOUD = os.path.join(REPO, "scripts", "cloud")
TOOLS = ("gcloud", "ssh", "bash", "python3", "gsutil")


@pytest.fixture
def trap_path(tmp_path):
    """A PATH whose only tools are fakes that record being called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "executed"
    for tool in TOOLS:
        fake = bin_dir / tool
        fake.write_text(f'#!/bin/sh\necho {tool} "$@" >> {marker}\n')
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir), marker


def run_script(name: str, args: list[str], path: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [sys.executable, os.path.join(CLOUD, name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def printed_commands(stdout: str) -> list[list[str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("+ ")]
    return [shlex.split(ln[2:]) for ln in lines]


def flag(command: list[str], name: str) -> str | None:
    values = [p.split("=", 1)[1] for p in command if p.startswith(f"--{name}=")]
    return values[-1] if values else None


@pytest.mark.parametrize("worker", ["all", "0"], ids=["multi-host", "single-host"])
def test_tpu_vm_dry_run(trap_path, worker):
    path, marker = trap_path
    result = run_script(
        "tpu_vm.py",
        [
            "all",
            "--name=sbm-pod",
            "--zone=us-central2-b",
            "--project=my-proj",
            "--accelerator_type=v4-32",
            f"--worker={worker}",
            "--config=configs/lra/listops.py:sbm,reduced",
            "--data_bucket=gs://my-bucket/lra_tfds/",
            "--output_dir=/tmp/runs/listops",
            "--override=--config.train.num_steps=100",
            "--dry_run",
        ],
        path,
    )
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), marker.read_text()
    commands = printed_commands(result.stdout)
    assert [c[:5] for c in commands] == [
        ["gcloud", "compute", "tpus", "tpu-vm", "create"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh"],
    ]
    assert flag(commands[0], "accelerator-type") == "v4-32"
    for command in commands:
        assert flag(command, "zone") == "us-central2-b"
        assert flag(command, "project") == "my-proj"
    for command in commands[1:]:  # every ssh/scp reaches the chosen workers
        assert flag(command, "worker") == worker
    scp = commands[2]
    assert os.path.join(REPO, "sbm_jax") in scp and "sbm-pod:sbm-jax" in scp
    assert "pip install -e '.[tpu]'" in flag(commands[3], "command")
    train = flag(commands[-1], "command")
    stage, _, run = train.rpartition(" && ")
    assert "gcloud storage rsync --recursive gs://my-bucket/lra_tfds /tmp/tfds" in stage
    assert shlex.split(run) == [
        "python3",
        "scripts/train.py",
        "--config=configs/lra/listops.py:sbm,reduced",
        "--config.task.data_dir=/tmp/tfds",
        "--output_dir=/tmp/runs/listops",
        "--config.train.num_steps=100",
    ]


def test_tpu_vm_delete_and_errors(trap_path):
    path, marker = trap_path
    result = run_script("tpu_vm.py", ["delete", "--name=a", "--zone=z", "--dry_run"], path)
    assert printed_commands(result.stdout) == [
        ["gcloud", "compute", "tpus", "tpu-vm", "delete", "a", "--quiet", "--zone=z"]
    ]
    result = run_script("tpu_vm.py", ["train", "--name=a", "--zone=z", "--dry_run"], path)
    assert result.returncode != 0 and "--config is required" in result.stderr
    bad = ["create", "--name=a", "--zone=z", "--data_bucket=/local", "--dry_run"]
    result = run_script("tpu_vm.py", bad, path)
    assert result.returncode != 0 and "--data_bucket must be a gs://" in result.stderr
    assert not marker.exists()


def test_without_dry_run_a_missing_gcloud_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_script("tpu_vm.py", ["delete", "--name=a", "--zone=z"], str(empty))
    assert result.returncode != 0
    assert "'gcloud' is not on PATH" in result.stderr and "--dry_run" in result.stderr


def test_gpu_node_dry_run_multi_node(trap_path):
    path, marker = trap_path
    result = run_script(
        "gpu_node.py",
        [
            "all",
            "--host=me@node1",
            "--num_nodes=2",
            "--node_rank=1",
            "--coordinator=node0:8476",
            "--gpus=0,1,2,3",
            "--config=configs/lra/image.py:sbm",
            "--data_dir=/data/tfds",
            "--dry_run",
        ],
        path,
    )
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    commands = printed_commands(result.stdout)
    assert [c[:2] for c in commands] == [["ssh", "me@node1"]] * 3
    assert commands[0][2] == "cd sbm-jax && python3 -m pip install -e '.[gpu]'"
    assert shlex.split(commands[2][2]) == [
        "cd",
        "sbm-jax",
        "&&",
        "CUDA_VISIBLE_DEVICES=0,1,2,3",
        "SBM_COORDINATOR=node0:8476",
        "SBM_NUM_PROCESSES=2",
        "SBM_PROCESS_ID=1",
        "python3",
        "scripts/train.py",
        "--config=configs/lra/image.py:sbm",
        "--config.task.data_dir=/data/tfds",
    ]


def test_gpu_node_local_and_errors(trap_path):
    path, marker = trap_path
    args = ["train", "--config=configs/synthetic.py:smoke", "--dry_run"]
    result = run_script("gpu_node.py", args, path)
    (command,) = printed_commands(result.stdout)
    assert command[:2] == ["bash", "-c"]
    assert command[2] == (
        f"cd {REPO} && python3 scripts/train.py --config=configs/synthetic.py:smoke"
    )
    bad = ["train", "--config=c.py", "--num_nodes=2", "--node_rank=2", "--coordinator=h:1"]
    result = run_script("gpu_node.py", [*bad, "--dry_run"], path)
    assert result.returncode != 0 and "--node_rank=2 is out of range" in result.stderr
    result = run_script("gpu_node.py", ["train", "--config=c.py", "--num_nodes=2"], path)
    assert result.returncode != 0 and "--coordinator" in result.stderr
    assert not marker.exists()


def test_prepare_data_bucket_dry_run(trap_path):
    path, marker = trap_path
    result = run_script(
        "prepare_data_bucket.py",
        [
            "--tasks=listops,retrieval",
            "--bucket=gs://my-bucket/lra_tfds",
            "--manual_dir=/data/lra_release",
            "--local_dir=/scratch/tfds",
            "--create_bucket",
            "--location=us-central2",
            "--prepare_flag=--num_workers=4",
            "--dry_run",
        ],
        path,
    )
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    commands = printed_commands(result.stdout)
    assert commands[0] == [
        "gcloud", "storage", "buckets", "create", "gs://my-bucket", "--location=us-central2"
    ]  # fmt: skip
    for command, task in zip(commands[1:3], ["listops", "retrieval"], strict=True):
        assert command[1:] == [
            "-m",
            "lra.prepare",
            f"--task={task}",
            "--data_dir=/scratch/tfds",
            "--manual_dir=/data/lra_release",
            "--num_workers=4",
        ]
    assert commands[3] == [
        "gcloud", "storage", "rsync", "--recursive", "/scratch/tfds", "gs://my-bucket/lra_tfds"
    ]  # fmt: skip
    result = run_script("prepare_data_bucket.py", ["--tasks=mnist", "--bucket=gs://b"], path)
    assert result.returncode != 0 and "--tasks: unknown ['mnist']" in result.stderr
