"""Helpers for tests that launch several Python processes (multi-process JAX on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Mapping, Sequence


def xla_flags(cpu_devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a test's subprocess: the suite's compile flags (tests/conftest.py)
    and, if given, a number of CPU devices."""
    flags = os.environ.get("SBM_TEST_XLA_FLAGS", "")
    if cpu_devices is not None:
        flags += f" --xla_force_host_platform_device_count={cpu_devices}"
    return flags.strip()


def free_port() -> int:
    """A TCP port on localhost that is free right now (for a coordinator address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_and_collect(
    commands: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float
) -> list[dict]:
    """Start every command at once; return the JSON after each one's last ``RESULT `` line.

    Fails (assert) with the tail of the output when a process exits non-zero or prints no
    result; kills the others on the way out.
    """
    procs = [
        subprocess.Popen(
            list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd in commands
    ]
    results = []
    try:
        for i, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"process {i} printed no result:\n{out[-4000:]}"
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results
