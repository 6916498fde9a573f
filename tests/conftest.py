"""pytest hooks shared by every test file.

Tests marked ``accelerator`` check the layer at sizes that matter on a GPU or TPU (the
backend's own head mapping, larger graphs). They run only where JAX's default backend
is not the CPU, or when ``SBM_ACCELERATOR_TESTS=1`` forces them (slowly) on a CPU;
elsewhere they are skipped, so the default run never depends on an accelerator.
"""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if not any("accelerator" in item.keywords for item in items):
        return
    import jax

    if jax.default_backend() != "cpu" or os.environ.get("SBM_ACCELERATOR_TESTS") == "1":
        return
    skip = pytest.mark.skip(
        reason="accelerator test: runs on GPU/TPU (or with SBM_ACCELERATOR_TESTS=1)"
    )
    for item in items:
        if "accelerator" in item.keywords:
            item.add_marker(skip)
