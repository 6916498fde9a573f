"""pytest hooks shared by every test file.

Tests marked ``accelerator`` check the layer at sizes that matter on a GPU or TPU (the
backend's own head mapping, larger graphs). They run only where JAX's default backend
is not the CPU, or when ``SBM_ACCELERATOR_TESTS=1`` forces them (slowly) on a CPU;
elsewhere they are skipped, so the default run never depends on an accelerator.
"""

import os

import pytest

# The tests' programs are small, many and compiled once each: on a CPU most of the default
# suite's time is XLA compiling them, about a third of that in LLVM's optimisation passes.
# The tests check numbers, not generated code, so XLA compiles their programs at backend
# optimisation level 0 (its HLO passes, fusion included, still run). Benchmarks, training
# and users' runs keep XLA's default; so does a test run that sets the level in XLA_FLAGS
# itself, one with SBM_TEST_FULL_OPT=1, and the accelerator tests (``-m accelerator``).
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def pytest_configure(config):
    flags = os.environ.get("XLA_FLAGS", "")
    if (
        os.environ.get("SBM_TEST_FULL_OPT") == "1"
        or "xla_backend_optimization_level" in flags
        or "accelerator" in (config.option.markexpr or "").replace("not accelerator", "")
    ):
        os.environ["SBM_TEST_XLA_FLAGS"] = ""
        return
    os.environ["SBM_TEST_XLA_FLAGS"] = FAST_COMPILE_FLAG  # subprocesses add theirs to it
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAG}".strip()


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
