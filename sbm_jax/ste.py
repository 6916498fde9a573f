"""Straight-through estimator for the sampled mask (paper eq. 9)."""

from __future__ import annotations

import jax


def straight_through(p: jax.Array) -> jax.Array:
    """Ones in the forward pass; the incoming gradient goes to ``p`` unchanged.

    Used as ``edge_scale=straight_through(p_e)`` on sampled edges, the score of edge
    ``e`` is ``1 * s_e`` in the forward pass while ``dL/dp_e = dL/da_e * s_e``
    (paper eq. 9), where ``a_e = M_e * s_e``.

    Written as ``1 + (p - stop_gradient(p))`` (exactly 1 for finite ``p``) rather than
    as a ``custom_vjp`` returning a constant: under ``vmap`` such a constant output is
    unbatched, so its cotangent arrives summed over the mapped axis and every example
    and head would receive the sum of all their gradients. This form stays batched
    like ``p``.
    """
    return 1.0 + (p - jax.lax.stop_gradient(p))
