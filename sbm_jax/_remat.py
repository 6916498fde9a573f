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
for the backward pass as ``jax.checkpoint`` intends. Small integer residuals and PRNG
keys are gated the same way on their bits (random bits depend on nothing else, so XLA
could draw them early). Large residuals (the saved activations) are passed on
untouched: a select over them would copy them.

:func:`call_recomputed_after_cotangent` is the same for a Linen module under
``nn.remat`` (the encoder's ``remat=True``, whose barrier XLA:CPU drops just the same):
an ``nn.custom_vjp`` whose forward pass is ``nn.vjp`` of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def _first_float(tree: Any) -> jax.Array:
    """One element of the first floating-point leaf of ``tree``."""
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.reshape(-1)[0].astype(jnp.float32)
    raise ValueError("recompute_after_cotangent: the function has no floating-point output")


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def _gated(vjp: Any, late: jax.Array, gate_size: int) -> Any:
    """``vjp`` (a pytree of residuals) with its residuals of at most ``gate_size``
    elements passed through a select on ``late`` that returns them unchanged unless
    ``late``: floating ones ``where(late, nan, r)``, integer ones and PRNG keys (random
    bits, such as dropout's, depend on nothing else, so XLA would draw them in the
    forward pass and keep them) ``where(late, 0, r)`` on their bits. Booleans pass."""

    def gate(r: Any) -> Any:
        if not isinstance(r, jax.Array) or r.size > gate_size:
            return r
        if jnp.issubdtype(r.dtype, jax.dtypes.prng_key):
            bits = jax.random.key_data(r)
            bits = jnp.where(late, jnp.zeros_like(bits), bits)
            return jax.random.wrap_key_data(bits, impl=jax.random.key_impl(r))
        if jnp.issubdtype(r.dtype, jnp.floating):
            return jnp.where(late, jnp.asarray(jnp.nan, r.dtype), r)
        if jnp.issubdtype(r.dtype, jnp.integer):
            return jnp.where(late, jnp.zeros_like(r), r)
        return r

    return jax.tree.map(gate, vjp)


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
        return _gated(vjp, jnp.isnan(_first_float(ct) + probe), gate_size)(ct)

    wrapped.defvjp(fwd, bwd)
    return wrapped


def call_recomputed_after_cotangent(fn: Callable[..., Any], block: nn.Module, *args: Any) -> Any:
    """``fn(block, *args)``, ``block`` a Linen module under ``nn.remat``, with its
    recomputation waiting for the cotangent as :func:`recompute_after_cotangent`'s does:
    a lifted custom VJP (``nn.custom_vjp``) whose forward pass is ``nn.vjp`` of the call
    and whose backward pass gates the residuals no larger than the block's largest
    parameter. Arguments that are not floating point (a mask) get no cotangent; static
    arguments of the call (``deterministic``) are closed over in ``fn``."""
    gate_size = 0

    def fwd(mdl: nn.Module, *xs: Any) -> tuple[Any, Any]:
        nonlocal gate_size
        out, vjp = nn.vjp(fn, mdl, *xs)
        params = jax.tree.leaves(mdl.variables.get("params", {}))
        gate_size = max((p.size for p in params), default=0)
        return out, (vjp, _first_float(out))

    def bwd(res: Any, ct: Any) -> Any:
        vjp, probe = res
        params_t, *inputs_t = _gated(vjp, jnp.isnan(_first_float(ct) + probe), gate_size)(ct)
        kept = (t if _is_float(x) else None for t, x in zip(inputs_t, args, strict=True))
        return (params_t, *kept)

    return nn.custom_vjp(fn, forward_fn=fwd, backward_fn=bwd)(block, *args)
