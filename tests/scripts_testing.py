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


def forget_script(module: str) -> None:
    """Remove the absl flags that ``module`` (e.g. ``"scripts.lra_sweep"``) defined, and
    the module itself, so that another script imported later in the same test process
    may define flags of the same names (lra_sweep and lra_report both take --root)."""
    import sys

    from absl import flags

    for flag in flags.FLAGS.get_flags_for_module(module):
        if flag.name in flags.FLAGS:
            delattr(flags.FLAGS, flag.name)
    sys.modules.pop(module, None)
    package, _, name = module.rpartition(".")
    if package in sys.modules and hasattr(sys.modules[package], name):
        delattr(sys.modules[package], name)  # so that the next import runs the module again
