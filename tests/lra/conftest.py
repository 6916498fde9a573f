"""Shared helpers for the LRA data tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "lra")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_in_checkout(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *args`` from the checkout's root, on the CPU, output captured as text
    (the way a user runs ``python -m lra.prepare``)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def fixtures_dir() -> str:
    return FIXTURES


@pytest.fixture(scope="session")
def small_listops_dir(tmp_path_factory) -> tuple[str, str]:
    """A tiny generated ListOps dataset: (data_dir, config name)."""
    from lra import builders

    data_dir = str(tmp_path_factory.mktemp("lra_data"))
    config = builders.make_config(
        "listops", num_train=37, num_validation=11, num_test=5, min_length=10, max_length=60
    )
    builders.make_builder("listops", config, data_dir=data_dir).download_and_prepare(
        file_format="array_record"
    )
    return data_dir, config.name
