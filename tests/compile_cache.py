"""A persistent XLA compilation cache for one test module: runs of the same config in
one process (or in subprocesses given ``env()``) compile each program once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

_NAMES = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def persistent_cache(directory: str) -> Iterator[None]:
    """Use ``directory`` as JAX's persistent cache inside the block, as before after."""
    saved = {name: getattr(jax.config, name) for name in _NAMES}
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()  # later modules see no cache, as before


def env(directory: str) -> dict[str, str]:
    """Environment variables giving a subprocess the same cache."""
    return {
        "JAX_COMPILATION_CACHE_DIR": directory,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        **{k: v for k, v in os.environ.items() if k == "PATH"},
    }
