"""Loop carries that work inside ``jax.shard_map``.

Inside ``jax.shard_map`` every value carries the set of mesh axes it varies over, and a
``lax.fori_loop`` / ``while_loop`` / ``scan`` requires its carry to have the same set on
the way in and out. A carry initialised from a constant (``jnp.zeros``) varies over
nothing, while the body, which reads per-device data, returns a varying one: JAX then
refuses the loop ("the manual axis types do not match"). :func:`vary_like` gives the
initial carry the axes of the operands the body reads; outside ``shard_map`` there are
none and it returns its input unchanged.

Written against both spellings of the API: JAX 0.8/0.9 (``aval.vma``, ``lax.pvary``)
and 0.10 (``aval.mat.varying``, ``lax.pcast(..., to="varying")``).
"""

from __future__ import annotations

from typing import Any

import jax


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # type: ignore[attr-defined]  # JAX < 0.10


def vary_like(init: Any, *operands: Any) -> Any:
    """``init`` (a pytree of arrays), each leaf made to vary over every mesh axis that
    any leaf of ``operands`` varies over. The values are unchanged."""
    axes = frozenset().union(*map(_varying_axes, jax.tree.leaves(operands)))
    if not axes:
        return init

    def one(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        return _vary(x, missing) if missing else x

    return jax.tree.map(one, init)
