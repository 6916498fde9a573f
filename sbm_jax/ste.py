"""Straight-through estimator for the sampled mask (paper eq. 9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def straight_through(p: jax.Array) -> jax.Array:
    """Ones in the forward pass; the incoming gradient goes to ``p`` unchanged.

    Used as ``edge_scale=straight_through(p_e)`` on sampled edges, the score of edge
    ``e`` is ``1 * s_e`` in the forward pass while ``dL/dp_e = dL/da_e * s_e``
    (paper eq. 9), where ``a_e = M_e * s_e``.
    """
    return jnp.ones_like(p)


def _ste_fwd(p: jax.Array) -> tuple[jax.Array, None]:
    return jnp.ones_like(p), None


def _ste_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    return (g,)


straight_through.defvjp(_ste_fwd, _ste_bwd)
