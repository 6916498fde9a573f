"""Shared pieces of the cloud launch scripts: a command runner with a dry-run mode and
the shell lines that set up a host and start a detached training job on it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

DEFAULT_REPO_DIR = "sbm-jax"  # checkout on remote machines, relative to the home dir
DEFAULT_VENV = "~/sbm-venv"  # virtual environment on remote machines
PYTHON_VERSION = "3.11"  # what the venv gets; constraints.txt was resolved with it
LOG_DIR = "~/sbm-logs"  # per-host job logs and pid files
JOB_SCRIPT = "scripts/cloud/train_job.sh"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a host needs from the checkout (no runs/, caches or virtual environments).
SOURCES = (
    "pyproject.toml",
    "constraints.txt",
    "README.md",
    "sbm_jax",
    "lra",
    "glue",
    "configs",
    "scripts",
)


class CommandRunner:
    """Runs commands one by one, or with ``dry_run`` only prints them.

    Every command is printed first as ``+ <shell-quoted command>``; in dry-run mode
    nothing is executed and no tool (gcloud, ssh) needs to be installed.
    """

    def __init__(self, dry_run: bool, stream=None) -> None:
        self.dry_run = dry_run
        self.stream = stream or sys.stdout
        self.commands: list[list[str]] = []

    def run(self, command: Sequence[str]) -> None:
        command = [str(part) for part in command]
        self.commands.append(command)
        print("+ " + shlex.join(command), file=self.stream, flush=True)
        if self.dry_run:
            return
        if shutil.which(command[0]) is None:
            raise SystemExit(
                f"{command[0]!r} is not on PATH; install it (gcloud: "
                "https://cloud.google.com/sdk/docs/install) or use --dry_run to print the commands"
            )
        subprocess.run(command, check=True)


def shell_path(path: str) -> str:
    """``path`` quoted for a remote shell, leaving a leading ``~/`` to be expanded there."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def train_command(
    config: str,
    data_dir: str | None,
    output_dir: str | None,
    overrides: Sequence[str] = (),
    python: str = "python3",
) -> str:
    """The shell command that trains ``config`` from the checkout root."""
    parts = [python, "scripts/train.py", f"--config={config}"]
    if data_dir:
        parts.append(f"--config.task.data_dir={data_dir}")
    if output_dir:
        parts.append(f"--output_dir={output_dir}")
    parts.extend(overrides)
    return " ".join(shell_path(p) if p.startswith("~/") else shlex.quote(p) for p in parts)


def venv_setup_command(venv: str, extras: str, python_version: str = PYTHON_VERSION) -> str:
    """Shell, run in the checkout: make a Python >= 3.11 venv and install the checkout.

    The system Python is often older (tpu-ubuntu2204-base has 3.10), so the venv is made
    by uv, which downloads a standalone ``python_version`` when the system has none;
    uv comes from pip (``--user``) or, where that is refused, from its installer. An
    existing venv with a new enough Python is kept. The install uses constraints.txt,
    the versions CI tests.
    """
    venv_q = shell_path(venv)
    uv = "~/.local/bin/uv"
    ok = f"{venv_q}/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'"
    get_uv = (
        f"{{ command -v uv >/dev/null || [ -x {uv} ] || python3 -m pip install --user -q uv "
        "|| curl -LsSf https://astral.sh/uv/install.sh | sh; }"
    )
    make = (
        f"{{ {get_uv} && rm -rf {venv_q} && "
        f"$(command -v uv || echo {uv}) venv --seed --python {shlex.quote(python_version)} "
        f"{venv_q}; }}"
    )
    install = (
        f"{venv_q}/bin/python -m pip install -q -c constraints.txt -e {shlex.quote(f'.[{extras}]')}"
    )
    return f"{{ {ok} 2>/dev/null || {make}; }} && {install}"


# Cloud Storage FUSE from Google's apt repository (Debian/Ubuntu), unless installed.
GCSFUSE_INSTALL = (
    "{ command -v gcsfuse >/dev/null || { "
    'echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] '
    'https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -c -s) main" '
    "| sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null && "
    "curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg "
    "| sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null && "
    "sudo apt-get update -q && sudo apt-get install -y -q gcsfuse; }; }"
)


def run_name(config: str, output_dir: str) -> str:
    """A file-name-safe name for a run's log: the output dir's last part, else the config."""
    if output_dir:
        name = output_dir.rstrip("/").rsplit("/", 1)[-1]
    else:
        path, _, preset = config.partition(":")
        name = os.path.splitext(os.path.basename(path))[0] + (f"-{preset}" if preset else "")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "run"


def log_path(name: str) -> str:
    return f"{LOG_DIR}/{name}.log"


def pid_path(name: str) -> str:
    return f"{LOG_DIR}/{name}.pid"


def detached_job_command(name: str, env: Mapping[str, str], train: str) -> str:
    """Shell, run in the checkout: start ``train`` under train_job.sh, detached.

    ``setsid nohup`` with every stream redirected: the ssh session that starts it can
    end (or drop) without ending the job. The log is appended to, so a rerun after a
    preemption keeps the first part.
    """
    settings = {"SBM_JOB_PIDFILE": pid_path(name), **env}
    assignments = " ".join(f"{k}={shell_path(v)}" for k, v in settings.items())
    log = log_path(name)
    # The braces put only the job in the background, with all its streams redirected:
    # nothing keeps the ssh session's stdout open, so ssh returns at once.
    return (
        f"mkdir -p {LOG_DIR} && {{ {assignments} setsid nohup bash {JOB_SCRIPT} {train} "
        f">> {shell_path(log)} 2>&1 < /dev/null & }} && "
        f'echo "started on $(hostname); log: {log}"'
    )


def stop_command(name: str) -> str:
    """Shell: SIGTERM to the trainer (it saves the latest checkpoint, then exits 0)."""
    pid = shell_path(pid_path(name))
    return (
        f'if [ -f {pid} ] && kill -0 "$(cat {pid})" 2>/dev/null; then '
        f'kill -TERM "$(cat {pid})" && echo "SIGTERM sent on $(hostname)"; '
        f'else echo "no running trainer on $(hostname)"; fi'
    )


def not_running_check(name: str) -> str:
    """Shell that fails while the trainer of ``name`` still runs on this host."""
    pid = shell_path(pid_path(name))
    return (
        f'if [ -f {pid} ] && kill -0 "$(cat {pid})" 2>/dev/null; then '
        f'echo "the trainer still runs on $(hostname): wait, stop it first, or use --force" >&2; '
        "exit 1; fi"
    )


def tail_command(name: str, follow: bool, lines: int = 100) -> str:
    return f"tail -n {lines} {'-F ' if follow else ''}{shell_path(log_path(name))}"


def check_bucket_path(value: str, flag: str) -> str:
    """``value`` if it is a gs:// path; a usage error naming ``flag`` otherwise."""
    if not value.startswith("gs://") or len(value) <= len("gs://"):
        raise SystemExit(f"{flag} must be a gs://bucket/path, got {value!r}")
    return value.rstrip("/")


def split_bucket_path(value: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``."""
    bucket, _, path = value[len("gs://") :].partition("/")
    return bucket, path.strip("/")
