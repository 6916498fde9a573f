"""Shared pieces of the cloud launch scripts: a command runner with a dry-run mode."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

DEFAULT_REPO_DIR = "sbm-jax"  # checkout on remote machines, relative to the home dir


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
    return shlex.join(parts)


def stage_data_command(bucket_dir: str, local_dir: str) -> str:
    """Copy a prepared TFDS directory from a bucket to local disk (idempotent rsync).

    ArrayRecord files are opened with POSIX I/O, which does not understand gs:// paths,
    so training reads a local copy (or a Cloud Storage FUSE mount).
    """
    return (
        f"mkdir -p {shlex.quote(local_dir)} && "
        f"gcloud storage rsync --recursive {shlex.quote(bucket_dir)} {shlex.quote(local_dir)}"
    )


def check_bucket_path(value: str, flag: str) -> str:
    """``value`` if it is a gs:// path; a usage error naming ``flag`` otherwise."""
    if not value.startswith("gs://") or len(value) <= len("gs://"):
        raise SystemExit(f"{flag} must be a gs://bucket/path, got {value!r}")
    return value.rstrip("/")
