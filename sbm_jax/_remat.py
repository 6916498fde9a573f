"""Rematerialisation that waits for the backward pass on every backend.

``jax.checkpoint`` recomputes a function's intermediates in the backward pass instead of
keeping them, and stops XLA from merging the recomputation with the forward pass's own
copy by an ``optimization_barrier`` over the recomputation's inputs (``prevent_cse``).
XLA:CPU expands that barrier away before it optimises, so there the recomputation has no
data dependence on the backward pass: XLA merges it with the forward computation (or
schedules it right after it), and the intermediates stay alive from the forward pass
to the backward one. For the SBM layer that is the memberships, ``Y S`` and the
membership MLP's activations: 48.6 MiB per added layer at n=4096, B=2, and 14.2 with
this module (``scripts/stack_memory.py``).

:func:`recompute_after_cotangent` wraps a checkpointed function in a custom VJP whose
backward pass passes the small floating-point residuals (the layer's weights, which
every recomputed value depends on) through a select on a scalar of the incoming
cotangent and of the forward output: ``where(isnan(c), nan, w)``. That is ``w`` itself
unless the cotangent is already NaN (when every gradient is NaN anyway), but XLA can
neither fold it nor compute it before the cotangent exists, so the recomputation waits
for the backward pass as ``jax.checkpoint`` intends. Large residuals (the saved
activations) are passed on untouched: a select over them would copy them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _first_float(tree: Any) -> jax.Array:
    """One element of the first floating-point leaf of ``tree``."""
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.reshape(-1)[0].astype(jnp.float32)
    raise ValueError("recompute_after_cotangent: the function has no floating-point output")


def recompute_after_cotangent(fn: Callable[..., Any], *, gate_size: int) -> Callable[..., Any]:
    """``fn`` (a ``jax.checkpoint``-ed function: same values and gradients) whose
    recomputation in the backward pass depends on the cotangent, so that no backend
    hoists it into the forward pass. ``gate_size``: floating-point residuals of at most
    this many elements are gated (pass the size of the largest weight)."""

    @jax.custom_vjp
    def wrapped(*args: Any) -> Any:
        return fn(*args)

    def fwd(*args: Any) -> tuple[Any, Any]:
        out, vjp = jax.vjp(fn, *args)
        return out, (vjp, _first_float(out))

    def bwd(res: Any, ct: Any) -> Any:
        vjp, probe = res
        # After the forward output (probe) and the cotangent (ct): a layer's cotangent may
        # not depend on its own output (a linear loss), and its output alone is ready as
        # soon as the layer's forward pass ends.
        late = jnp.isnan(_first_float(ct) + probe)

        def gate(r: Any) -> Any:
            if (
                isinstance(r, jax.Array)
                and jnp.issubdtype(r.dtype, jnp.floating)
                and r.size <= gate_size
            ):
                return jnp.where(late, jnp.asarray(jnp.nan, r.dtype), r)
            return r

        return jax.tree.map(gate, vjp)(ct)

    wrapped.defvjp(fwd, bwd)
    return wrapped
