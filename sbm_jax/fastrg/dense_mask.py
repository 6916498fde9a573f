"""The same edge law as fastRG, drawn densely pair by pair (O(nm)): the reference the
sparse sampler is tested against, and its fallback where the bernoulli bound is near 1."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbm_jax._random import uniform
from sbm_jax.fastrg.plan import SamplingPlan, check_law


def dense_probs(plan: SamplingPlan) -> jax.Array:
    """``[n, m]`` matrix ``p = Qhat S Khat^T`` (masked, without delta)."""
    k = plan.ys.shape[1]
    return plan.ys @ plan.z[:, :k].T


def sample_dense_mask(
    key: jax.Array,
    p: jax.Array,
    delta: float | jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    law: str = "bernoulli",
) -> jax.Array:
    """``[n, m]`` bool mask drawn pair by pair with the same law as the sparse sampler."""
    check_law(law)
    rate = jax.lax.stop_gradient(p + delta)
    prob = jnp.minimum(rate, 1.0) if law == "bernoulli" else -jnp.expm1(-rate)
    real = q_mask[:, None] & k_mask[None, :]
    return (uniform(key, p.shape) < prob) & real
