"""Named scopes for the SBM layer's parts, so that a profile can say where time goes.

``jax.named_scope`` only labels the operations (their HLO ``op_name`` metadata); it
changes nothing that runs. ``scripts/profile_layer.py`` groups an XLA trace by these
names. The order of :data:`PARTS` is the order a profile lists them in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])

MEMBERSHIPS = "sbm_memberships"  # membership MLP, Y and Z, the block matrix S
PLAN = "sbm_plan"  # fastRG's plan: Y S, bounds, CDFs, guide tables
SAMPLE = "sbm_sample"  # fastRG: row counts, inverse-CDF searches, sort, thinning
EDGE_KERNEL = "sbm_edge_kernel"  # attention over the sampled edges (rows kernel)
STE_BACKWARD = "sbm_ste_backward"  # eq. 9's SpMMs into Y S and Z
DENSE_PATH = "sbm_dense_path"  # the streamed dense-graph branch

PARTS = (MEMBERSHIPS, PLAN, SAMPLE, EDGE_KERNEL, STE_BACKWARD, DENSE_PATH)


def scoped(name: str) -> Callable[[F], F]:
    """Decorator: run the function under ``jax.named_scope(name)``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
