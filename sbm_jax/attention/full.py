"""Full softmax attention, the reference mechanism every efficient one is compared with.

Registered as ``"full"``. Every query attends to every real key (padded keys are masked
out), through ``jax.nn.dot_product_attention``, which picks a fused kernel where the
backend has one. Attention dropout, which that function does not offer, uses an explicit
softmax path during training.

Statistics follow the registry contract so that plots and logs treat every mechanism
alike: ``density`` is 1 (every real query-key pair is attended) and ``edges`` is the
number of real pairs, both ``[batch, heads]``. The density is a constant, so a density
regulariser adds nothing to full attention's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import attention_call, head_dense, out_dense
from sbm_jax.attention.counting import SOFTMAX, projection_flops, projection_params
from sbm_jax.attention.registry import STATS_COLLECTION, register

Array = jax.Array


def full_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head ``scale nd``, ``scores 2n^2 d``, ``softmax 5n^2``,
    ``aggregation 2n^2 d``."""
    return {
        **projection_flops(n, D, H, d),
        "scale": H * n * d,
        "scores": H * 2.0 * n * n * d,
        "softmax": H * SOFTMAX * n * n,
        "aggregation": H * 2.0 * n * n * d,
    }


def full_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections with biases."""
    return projection_params(D, H, d)


@register("full", flops=full_flops, params=full_params)
class FullAttention(nn.Module):
    """Multi-head softmax attention over all real tokens.

    Attributes:
      num_heads: number of heads H.
      head_dim: per-head width d_h of queries, keys and values.
      out_dim: width of the output (the model width).
      attention_dropout: dropout rate on the attention weights (training only).
      dtype: compute dtype; parameters stay float32.
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32

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
        """x [batch, length, dim], mask [batch, length] bool -> [batch, length, out_dim]."""
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        batch, length, _ = x.shape
        mask = mask.astype(jnp.bool_)

        def project(name: str) -> Array:
            dense = head_dense(self.num_heads, self.head_dim, self.dtype, name)
            return dense(x)  # [batch, length, heads, head_dim]

        q, k, v = project("query"), project("key"), project("value")
        # Only keys are masked: padded queries still see real keys (their outputs are
        # ignored downstream), so no row is empty and nothing turns NaN.
        key_mask = mask[:, None, None, :]  # [batch, 1, 1, length]
        if deterministic or self.attention_dropout == 0.0:
            out = jax.nn.dot_product_attention(q, k, v, mask=key_mask)
        else:
            scale = 1.0 / jnp.sqrt(jnp.asarray(self.head_dim, jnp.float32))
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            logits = logits * scale  # float32 scores, not bf16 ones cast up
            logits = jnp.where(key_mask, logits, jnp.finfo(jnp.float32).min)
            weights = jax.nn.softmax(logits, axis=-1)
            keep_prob = 1.0 - self.attention_dropout
            keep = jax.random.bernoulli(self.make_rng("dropout"), keep_prob, weights.shape)
            weights = jnp.where(keep, weights / keep_prob, 0.0).astype(v.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        chex.assert_shape(out, (batch, length, self.num_heads, self.head_dim))

        real = jnp.sum(mask, axis=-1, dtype=jnp.float32)  # [batch]
        edges = jnp.broadcast_to((real * real)[:, None], (batch, self.num_heads))
        density = jnp.where(edges > 0, 1.0, 0.0)
        self.sow(STATS_COLLECTION, "density", density)
        self.sow(STATS_COLLECTION, "edges", edges)

        out = out_dense(self.out_dim, self.dtype)(out)
        return out  # [batch, length, out_dim]
