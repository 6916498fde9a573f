"""The cloud launch scripts.

Dry-run mode: the printed commands carry the right worker flags, config, venv, data and
output dirs and environment, training starts detached, and nothing is executed.
scripts/cloud/train_job.sh (what runs on each host) is run here for real against fake
gcloud / gcsfuse tools and a fake trainer: a preemption (SIGTERM to every process) lets
the trainer save once and the results reach the bucket, and a rerun on a fresh machine
resumes from there.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOUD = os.path.join(REPO, "scripts", "cloud")
TOOLS = ("gcloud", "ssh", "bash", "python3", "gsutil", "rsync", "scp")


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


def detached_job(remote: str) -> tuple[list[str], dict[str, str], list[str], str]:
    """Split a remote 'cd R && mkdir -p L && { ENV setsid nohup bash JOB TRAIN >> LOG
    2>&1 < /dev/null & } && echo ...' line into (prefix, env, train argv, log)."""
    words = shlex.split(remote)
    start = words.index("{")
    end = words.index("}")
    group = words[start + 1 : end]
    prefix = words[:start]
    setsid = group.index("setsid")
    env = dict(w.split("=", 1) for w in group[:setsid])
    assert group[setsid : setsid + 4] == ["setsid", "nohup", "bash", "scripts/cloud/train_job.sh"]
    rest = group[setsid + 4 :]
    redirect = rest.index(">>")
    assert rest[redirect + 2 :] == ["2>&1", "<", "/dev/null", "&"]  # every stream redirected
    assert words[end + 1 : end + 3] == ["&&", "echo"]
    return prefix, env, rest[:redirect], rest[redirect + 1]


TPU_ARGS = [
    "--name=sbm-pod",
    "--zone=us-central2-b",
    "--project=my-proj",
    "--accelerator_type=v4-32",
    "--config=configs/lra/listops.py:sbm,reduced",
    "--data_bucket=gs://my-bucket/lra_tfds/",
    "--output_dir=gs://my-bucket/runs/listops/",
    "--override=--config.train.num_steps=100",
    "--dry_run",
]


@pytest.mark.parametrize("worker", ["all", "0"], ids=["multi-host", "single-host"])
def test_tpu_vm_dry_run(trap_path, worker):
    path, marker = trap_path
    result = run_script("tpu_vm.py", ["all", f"--worker={worker}", "--spot", *TPU_ARGS], path)
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
    ]  # `all` is create, setup, train: no delete
    create = commands[0]
    assert flag(create, "accelerator-type") == "v4-32" and "--spot" in create
    assert flag(create, "scopes") == "https://www.googleapis.com/auth/cloud-platform"
    for command in commands:
        assert flag(command, "zone") == "us-central2-b"
        assert flag(command, "project") == "my-proj"
    for command in commands[1:]:  # every ssh/scp reaches the chosen workers
        assert flag(command, "worker") == worker
    scp = commands[2]
    for source in ("sbm_jax", "configs", "scripts", "constraints.txt", "pyproject.toml"):
        assert os.path.join(REPO, source) in scp
    assert "sbm-pod:sbm-jax" in scp

    setup = flag(commands[3], "command")
    # A Python 3.11 venv (the image's python3 is 3.10), the pinned versions, gcsfuse.
    assert setup.startswith("cd sbm-jax && ")
    assert "uv) venv --seed --python 3.11 ~/sbm-venv" in setup
    assert "sys.version_info < (3, 11)" in setup
    assert "~/sbm-venv/bin/python -m pip install -q -c constraints.txt -e '.[lra,tpu]'" in setup
    assert "apt-get install -y -q gcsfuse" in setup
    assert flag(commands[4], "command").startswith("~/sbm-venv/bin/python -c ")

    prefix, env, train, log = detached_job(flag(commands[5], "command"))
    assert prefix == ["cd", "sbm-jax", "&&", "mkdir", "-p", "~/sbm-logs", "&&"]
    assert log == "~/sbm-logs/listops.log"
    assert env == {
        "SBM_JOB_PIDFILE": "~/sbm-logs/listops.pid",
        "SBM_JOB_BUCKET_DIR": "gs://my-bucket/runs/listops",
        "SBM_JOB_RUN_DIR": "runs/gcs/my-bucket/runs/listops",
        "SBM_JOB_MOUNT": "~/gcs/my-bucket",
        "SBM_JOB_SYNC_EVERY": "120",
        "SBM_JOB_DATA_BUCKET": "gs://my-bucket/lra_tfds",
        "SBM_JOB_DATA_DIR": "/tmp/tfds",
    }
    assert train == [
        "~/sbm-venv/bin/python",
        "scripts/train.py",
        "--config=configs/lra/listops.py:sbm,reduced",
        "--config.task.data_dir=/tmp/tfds",
        "--output_dir=runs/gcs/my-bucket/runs/listops",  # = SBM_JOB_RUN_DIR
        "--config.train.num_steps=100",
    ]


def test_tpu_vm_preemption_resume_and_delete(trap_path):
    """A preempted Spot VM: delete it (--force: it cannot be reached), run `all` again
    with the same --output_dir: the same trainer command and bucket dir (it resumes);
    `stop` sends SIGTERM; a plain `delete` refuses while a trainer runs and copies the
    logs to the bucket before the VM goes."""
    path, marker = trap_path
    first = printed_commands(run_script("tpu_vm.py", ["all", *TPU_ARGS], path).stdout)
    result = run_script("tpu_vm.py", ["delete", "--force", *TPU_ARGS], path)
    assert printed_commands(result.stdout) == [
        ["gcloud", "compute", "tpus", "tpu-vm", "delete", "sbm-pod", "--quiet"]
        + ["--zone=us-central2-b", "--project=my-proj"]
    ]
    again = printed_commands(run_script("tpu_vm.py", ["all", *TPU_ARGS], path).stdout)
    assert again == first

    (stop,) = printed_commands(run_script("tpu_vm.py", ["stop", *TPU_ARGS], path).stdout)
    assert flag(stop, "worker") == "all"
    assert 'kill -TERM "$(cat ~/sbm-logs/listops.pid)"' in flag(stop, "command")

    result = run_script("tpu_vm.py", ["delete", *TPU_ARGS], path)
    guard, delete = printed_commands(result.stdout)
    remote = flag(guard, "command")
    check, _, copy = remote.partition("fi; ")
    assert 'kill -0 "$(cat ~/sbm-logs/listops.pid)"' in check and "exit 1" in check
    assert copy == (
        'gcloud storage cp ~/sbm-logs/listops.log gs://my-bucket/runs/listops/logs/"$(hostname).log"'
    )
    assert flag(guard, "worker") == "all"
    assert delete[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "sbm-pod"]

    no_output = [a for a in TPU_ARGS if not a.startswith("--output_dir")]
    result = run_script("tpu_vm.py", ["delete", *no_output], path)
    assert result.returncode != 0 and "--output_dir=gs://bucket/path is required" in result.stderr
    assert "--force" in result.stderr
    assert not marker.exists()


def test_tpu_vm_logs_and_fetch(trap_path):
    path, marker = trap_path
    result = run_script("tpu_vm.py", ["logs", "--follow", *TPU_ARGS], path)
    (logs,) = printed_commands(result.stdout)
    assert flag(logs, "worker") == "0"  # one worker's log; --worker=N picks another
    assert flag(logs, "command") == "tail -n 100 -F ~/sbm-logs/listops.log"
    result = run_script("tpu_vm.py", ["fetch", *TPU_ARGS], path)
    (fetch,) = printed_commands(result.stdout)
    assert fetch == [
        "gcloud", "storage", "rsync", "--recursive", "--exclude=^(checkpoints|nonfinite)/",
        "gs://my-bucket/runs/listops", "runs/listops", "--project=my-proj",
    ]  # fmt: skip
    assert not marker.exists()


def test_tpu_vm_errors(trap_path):
    path, marker = trap_path
    result = run_script("tpu_vm.py", ["train", "--name=a", "--zone=z", "--dry_run"], path)
    assert result.returncode != 0 and "--config is required" in result.stderr
    bad = ["train", "--name=a", "--zone=z", "--config=c.py", "--dry_run"]
    result = run_script("tpu_vm.py", bad, path)
    assert result.returncode != 0 and "--output_dir=gs://bucket/path is required" in result.stderr
    result = run_script("tpu_vm.py", [*bad, "--output_dir=/tmp/runs/x"], path)
    assert result.returncode != 0 and "--output_dir must be a gs://" in result.stderr
    result = run_script("tpu_vm.py", [*bad, "--output_dir=gs://bucket"], path)
    assert result.returncode != 0 and "needs a path inside the bucket" in result.stderr
    bad = ["create", "--name=a", "--zone=z", "--data_bucket=/local", "--dry_run"]
    result = run_script("tpu_vm.py", bad, path)
    assert result.returncode != 0 and "--data_bucket must be a gs://" in result.stderr
    assert not marker.exists()


def test_without_dry_run_a_missing_gcloud_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_script("tpu_vm.py", ["delete", "--force", "--name=a", "--zone=z"], str(empty))
    assert result.returncode != 0
    assert "'gcloud' is not on PATH" in result.stderr and "--dry_run" in result.stderr


def test_gpu_node_dry_run_multi_node(trap_path):
    """Two nodes from one command: the checkout copied to each, a venv on each, node 0
    started first with rank 0, every node given the coordinator address."""
    path, marker = trap_path
    result = run_script(
        "gpu_node.py",
        [
            "all",
            "--hosts=me@node0,me@node1",
            "--gpus=0,1,2,3",
            "--config=configs/lra/image.py:sbm",
            "--data_bucket=gs://my-bucket/lra_tfds",
            "--output_dir=/shared/runs/image",
            "--dry_run",
        ],
        path,
    )
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    commands = printed_commands(result.stdout)
    assert [c[:2] for c in commands] == (
        [["ssh", "me@node0"], ["rsync", "-az"], ["ssh", "me@node0"], ["ssh", "me@node0"]]
        + [["ssh", "me@node1"], ["rsync", "-az"], ["ssh", "me@node1"], ["ssh", "me@node1"]]
        + [["ssh", "me@node0"], ["ssh", "me@node1"]]
    )
    for node, base in (("me@node0", 0), ("me@node1", 4)):
        assert commands[base][2] == "mkdir -p sbm-jax"
        rsync = commands[base + 1]
        assert rsync[-1] == f"{node}:sbm-jax/"
        assert os.path.join(REPO, "sbm_jax") in rsync and os.path.join(REPO, "configs") in rsync
        setup = commands[base + 2][2]
        assert setup.startswith("cd sbm-jax && ")
        assert "uv) venv --seed --python 3.11 ~/sbm-venv" in setup
        assert setup.endswith(
            "~/sbm-venv/bin/python -m pip install -q -c constraints.txt -e '.[lra,gpu]'"
        )
    for rank, command in enumerate(commands[8:]):
        prefix, env, train, log = detached_job(command[2])
        assert prefix == ["cd", "sbm-jax", "&&", "mkdir", "-p", "~/sbm-logs", "&&"]
        assert log == "~/sbm-logs/image.log"
        assert env == {
            "SBM_JOB_PIDFILE": "~/sbm-logs/image.pid",
            "SBM_JOB_DATA_BUCKET": "gs://my-bucket/lra_tfds",
            "SBM_JOB_DATA_DIR": "/tmp/tfds",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3",
            "SBM_COORDINATOR": "node0:8476",
            "SBM_NUM_PROCESSES": "2",
            "SBM_PROCESS_ID": str(rank),
        }
        assert train == [
            "~/sbm-venv/bin/python",
            "scripts/train.py",
            "--config=configs/lra/image.py:sbm",
            "--config.task.data_dir=/tmp/tfds",
            "--output_dir=/shared/runs/image",
        ]

    args = ["--hosts=me@node0,me@node1", "--output_dir=/shared/runs/image", "--dry_run"]
    result = run_script("gpu_node.py", ["logs", "--node=1", "--follow", *args], path)
    assert printed_commands(result.stdout) == [
        ["ssh", "me@node1", "cd sbm-jax && tail -n 100 -F ~/sbm-logs/image.log"]
    ]
    result = run_script("gpu_node.py", ["stop", *args], path)
    stops = printed_commands(result.stdout)
    assert [c[:2] for c in stops] == [["ssh", "me@node0"], ["ssh", "me@node1"]]
    assert all('kill -TERM "$(cat ~/sbm-logs/image.pid)"' in c[2] for c in stops)
    assert not marker.exists()


def test_gpu_node_local_and_errors(trap_path):
    path, marker = trap_path
    args = ["train", "--config=configs/synthetic.py:smoke", "--coordinator=x:1", "--dry_run"]
    result = run_script("gpu_node.py", args, path)
    (command,) = printed_commands(result.stdout)
    assert command[:2] == ["bash", "-c"]
    prefix, env, train, log = detached_job(command[2])
    assert prefix[:3] == ["cd", REPO, "&&"]
    assert env == {"SBM_JOB_PIDFILE": "~/sbm-logs/synthetic-smoke.pid"}  # one process
    assert train == [
        os.path.join(REPO, ".venv", "bin", "python"),
        "scripts/train.py",
        "--config=configs/synthetic.py:smoke",
    ]
    assert log == "~/sbm-logs/synthetic-smoke.log"

    two = ["train", "--config=c.py", "--hosts=a,b", "--dry_run"]
    result = run_script("gpu_node.py", two, path)
    assert result.returncode != 0 and "--output_dir is required with 2 hosts" in result.stderr
    result = run_script("gpu_node.py", ["logs", "--hosts=a", "--node=1", "--config=c.py"], path)
    assert result.returncode != 0 and "--node=1 is out of range" in result.stderr
    both = ["train", "--config=c.py", "--data_dir=/d", "--data_bucket=gs://b/d"]
    result = run_script("gpu_node.py", both, path)
    assert result.returncode != 0 and "not both" in result.stderr
    no_port = [*two[:3], "--output_dir=/nfs/r", "--coordinator=node0", "--dry_run"]
    result = run_script("gpu_node.py", no_port, path)
    assert result.returncode != 0 and "--coordinator must be host:port" in result.stderr
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


# ---- scripts/cloud/train_job.sh, run for real against fakes ----------------------------

FAKE_GCLOUD = """
import os, re, shutil, sys

root = os.environ["FAKE_GCS"]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")

def local(p):
    return os.path.join(root, p[len("gs://"):]) if p.startswith("gs://") else p

args = sys.argv[1:]
assert args[:2] == ["storage", "rsync"] or args[:2] == ["storage", "cp"], args
opts = [a for a in args[2:] if a.startswith("--")]
src, dst = [local(a) for a in args[2:] if not a.startswith("--")]
if args[1] == "cp":
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy(src, dst)
    sys.exit(0)
if not os.path.isdir(src):
    sys.exit("rsync: no such source " + src)
exclude = [o.split("=", 1)[1] for o in opts if o.startswith("--exclude=")]
for d, dirs, files in os.walk(src):
    for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
        path = os.path.join(d, name)
        rel = os.path.relpath(path, src)
        if os.path.islink(path) and "--ignore-symlinks" in opts:
            continue
        if any(re.search(e, rel) for e in exclude) or os.path.isdir(path):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy(path, os.path.join(dst, rel))
"""

FAKE_GCSFUSE = """
import os, sys

bucket, mount = sys.argv[-2:]
target = os.path.join(os.environ["FAKE_GCS"], bucket)
os.makedirs(target, exist_ok=True)
os.rmdir(mount)
os.symlink(target, mount)
"""

# The trainer's contract: it resumes from the newest checkpoint in <output_dir>/checkpoints,
# appends to metrics.jsonl, and on SIGTERM saves a checkpoint and exits 0 (a second signal
# while saving would end it without one, so it counts them).
FAKE_TRAINER = """
import json, os, signal, sys, time

out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--output_dir=")][0]
total = int(os.environ["FAKE_STEPS"])
signals = []
signal.signal(signal.SIGTERM, lambda *_: signals.append("TERM"))
ckpt = os.path.join(out, "checkpoints", "latest")
step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
print("resuming at step", step, flush=True)
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    while step < total and not signals:
        step += 1
        f.write(json.dumps({"step": step}) + "\\n")
        f.flush()
        time.sleep(0.1)
with open(ckpt, "w") as f:
    f.write(str(step))
time.sleep(0.5)  # saving: a second SIGTERM now would arrive here
with open(os.environ["FAKE_SIGNALS"], "a") as f:
    f.write(f"{len(signals)}\\n")
print("stopped" if signals else "finished", "at step", step, flush=True)
"""


def _write_tool(directory, name: str, source: str) -> None:
    tool = directory / name
    tool.write_text(f"#!{sys.executable}\n{textwrap.dedent(source)}")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def _start_job(tmp_path, host: str, steps: int) -> tuple[subprocess.Popen, dict[str, str]]:
    bin_dir = tmp_path / "fakebin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        _write_tool(bin_dir, "gcloud", FAKE_GCLOUD)
        _write_tool(bin_dir, "gcsfuse", FAKE_GCSFUSE)
        (bin_dir / "mountpoint").write_text('#!/bin/sh\ntest -L "$2"\n')
        (bin_dir / "mountpoint").chmod(0o755)
    home = tmp_path / host  # one machine: its checkout dir, mount point and pid file
    home.mkdir(exist_ok=True)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(home),
        "FAKE_GCS": str(tmp_path / "gcs"),
        "FAKE_CALLS": str(tmp_path / "gcloud_calls"),
        "FAKE_SIGNALS": str(tmp_path / "signals"),
        "FAKE_STEPS": str(steps),
        "SBM_JOB_PIDFILE": str(home / "trainer.pid"),
        "SBM_JOB_BUCKET_DIR": "gs://bkt/runs/exp",
        "SBM_JOB_RUN_DIR": "runs/gcs/bkt/runs/exp",
        "SBM_JOB_MOUNT": str(home / "gcs" / "bkt"),
        "SBM_JOB_SYNC_EVERY": "1",
    }
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    command = [os.path.join(CLOUD, "train_job.sh"), sys.executable, str(trainer)]
    command.append(f"--output_dir={env['SBM_JOB_RUN_DIR']}")
    job = subprocess.Popen(
        ["bash", *command],
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return job, env


def _bucket_steps(tmp_path) -> list[int]:
    path = tmp_path / "gcs" / "bkt" / "runs" / "exp" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_train_job_survives_preemption_and_resumes(tmp_path):
    # Host A: train until preempted. A preemption signals every process on the VM.
    job, env = _start_job(tmp_path, "host_a", steps=1000)
    deadline = time.time() + 60
    bucket_metrics = tmp_path / "gcs" / "bkt" / "runs" / "exp" / "metrics.jsonl"
    while not (bucket_metrics.exists() and bucket_metrics.stat().st_size > 0):
        assert job.poll() is None, job.communicate()[0]
        assert time.time() < deadline, "metrics never reached the bucket"
        time.sleep(0.2)
    trainer_pid = int(open(env["SBM_JOB_PIDFILE"]).read())
    os.kill(job.pid, signal.SIGTERM)
    os.kill(trainer_pid, signal.SIGTERM)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    assert "stopped at step" in out and "waiting for the trainer" in out
    assert (tmp_path / "signals").read_text().split() == ["1"]  # the trainer got one SIGTERM
    saved = int((tmp_path / "gcs" / "bkt" / "runs" / "exp" / "checkpoints" / "latest").read_text())
    assert saved > 0  # written through the mount, i.e. into the bucket
    steps = _bucket_steps(tmp_path)
    assert steps == list(range(1, saved + 1))  # copied again after the trainer exited
    calls = (tmp_path / "gcloud_calls").read_text()
    assert "--exclude=^(checkpoints|nonfinite|logs)/" in calls  # metrics only, not via rsync

    # Host B (a new VM, nothing on its disk): the same job resumes from the bucket.
    job, env = _start_job(tmp_path, "host_b", steps=saved + 5)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    assert f"resuming at step {saved}" in out and f"finished at step {saved + 5}" in out
    assert _bucket_steps(tmp_path) == list(range(1, saved + 6))  # continued, no gap
    local = tmp_path / "host_b" / "runs" / "gcs" / "bkt" / "runs" / "exp"
    assert os.path.islink(local / "checkpoints")


def test_train_job_exit_status_and_usage(tmp_path):
    result = subprocess.run(
        ["bash", os.path.join(CLOUD, "train_job.sh")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "usage" in result.stderr
    pidfile = tmp_path / "pid"
    result = subprocess.run(
        ["bash", os.path.join(CLOUD, "train_job.sh"), sys.executable, "-c", "exit(3)"],
        env={**os.environ, "SBM_JOB_PIDFILE": str(pidfile), "SBM_JOB_SYNC_EVERY": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stdout + result.stderr  # the trainer's status
    assert int(pidfile.read_text()) > 0
