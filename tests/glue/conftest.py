"""Shared helpers of the GLUE tests: config loading and a small local corpus."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(name: str, arg: str):
    """``get_config(arg)`` of configs/glue/<name>.py, as ``--config=path:arg`` would."""
    path = os.path.join(ROOT, "configs", "glue", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"glue_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.fixture(scope="session")
def corpus_glob() -> str:
    """The project's own docs/*.md: a few tens of KB of English text."""
    pattern = os.path.join(ROOT, "docs", "*.md")
    return pattern
