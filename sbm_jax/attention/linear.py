"""Linear Transformer attention (Katharopoulos et al., 2020), O(n d^2).

With the feature map ``phi(x) = elu(x) + 1`` (elementwise, positive), the attention of
query i is the kernel-normalised average

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps),

computed right to left so that no n x n matrix is formed. Padded keys have their
features and values zeroed, so they drop out of both sums exactly. The keys and values
may come from another sequence than the queries (cross-attention): the sums run over
the keys only.

``attention_dropout`` is not applied: no attention weights are ever formed (as in the
paper and in the LRA reference code).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import (
    check_real,
    compute_dtype,
    cross_attention_call,
    project_out,
    project_qkv,
)
from sbm_jax.attention.counting import projection_flops, projection_params
from sbm_jax.attention.registry import register

Array = jax.Array


def elu_feature_map(x: Array) -> Array:
    """phi(x) = elu(x) + 1, elementwise and strictly positive; shape preserved."""
    return jax.nn.elu(x) + 1.0


def linear_attention(q: Array, k: Array, v: Array, mask: Array, eps: float = 1e-6) -> Array:
    """Normalised linear attention with the elu+1 feature map.

    Args:
      q: [batch, n, heads, d].
      k: [batch, m, heads, d] (m = n when a sequence attends to itself).
      v: [batch, m, heads, dv].
      mask: bool [batch, m], True for real keys (padded keys are removed).
      eps: added to the normaliser (keeps rows with no real key finite).

    Returns:
      [batch, n, heads, dv].
    """
    keep = mask.astype(q.dtype)[:, :, None, None]
    phi_q = elu_feature_map(q)
    phi_k = elu_feature_map(k) * keep  # padded keys contribute nothing
    v = v * keep
    kv = jnp.einsum("bnhd,bnhe->bhde", phi_k, v)  # [B, H, d, dv]
    k_sum = jnp.sum(phi_k, axis=1)  # [B, H, d]
    numerator = jnp.einsum("bnhd,bhde->bnhe", phi_q, kv)
    denominator = jnp.einsum("bnhd,bhd->bnh", phi_q, k_sum)
    return numerator / (denominator[..., None] + eps)


def linear_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head ``feature_map 2 * 3nd`` (elu, +1 on Q and K), ``kv 2nd^2``,
    ``normaliser nd + 2nd`` (key sum, phi(Q) . sum), ``aggregation 2nd^2``, ``divide nd``."""
    return {
        **projection_flops(n, D, H, d),
        "feature_map": H * 2 * 3.0 * n * d,
        "kv": H * 2.0 * n * d * d,
        "normaliser": H * (n * d + 2.0 * n * d),
        "aggregation": H * 2.0 * n * d * d,
        "divide": H * n * d,
    }


def linear_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections with biases."""
    return projection_params(D, H, d)


@register("linear", flops=linear_flops, params=linear_params)
class LinearAttention(nn.Module):
    """Linear Transformer attention with the elu(x)+1 feature map.

    Options: ``eps`` (normaliser offset, default 1e-6 as in the paper's code).
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    eps: float = 1e-6

    def validate(self) -> None:
        """Raise ValueError naming the bad option (the config check calls it too)."""
        check_real("model.attention_options.eps", self.eps)

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        mask: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """x [B, n, dim], mask [B, n] (True = real) -> [B, n, out_dim]; or across two
        sequences, inputs_k / inputs_v [B, m, dim] with a key mask -> [B, n, out_dim]."""
        del deterministic  # no randomness: attention weights are never formed
        x, x_k, x_v, mask, _ = cross_attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        self.validate()
        q, k, v = project_qkv(x, self.num_heads, self.head_dim, self.dtype, x_k, x_v)
        ct = compute_dtype(self.dtype)
        out = linear_attention(q.astype(ct), k.astype(ct), v.astype(ct), mask, self.eps)
        return project_out(out, self.out_dim, self.dtype)
