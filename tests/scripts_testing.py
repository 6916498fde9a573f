"""Loading ``scripts/<name>.py`` in tests (the scripts are not a package)."""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, loaded once per process: a script may define absl flags, which
    may exist only once."""
    spec = importlib.util.spec_from_file_location(
        f"{name}_script", os.path.join(ROOT, "scripts", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
