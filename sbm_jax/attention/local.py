"""Sliding-window (local) attention, computed blockwise in O(n * window).

Convention: with ``r = window // 2``, query i attends to key j when ``|i - j| <= r``
(bidirectional, ``2r + 1`` keys away from the edges, itself included); ``causal=True``
keeps only ``i - r <= j <= i``. Padded keys are removed; a real query always sees
itself, so no real row is empty.

The sequence is cut into blocks of ``b = min(r, n)`` positions (at least 1); a key
within distance r of a query lies in the query's block or one of its two neighbours,
so each block attends to 3b keys and the band mask is applied inside that window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import attention_call, check_int, head_dense, out_dense
from sbm_jax.attention.counting import SOFTMAX, projection_flops, projection_params
from sbm_jax.attention.masked import masked_attention
from sbm_jax.attention.registry import STATS_COLLECTION, register

Array = jax.Array


def band_mask(n: int, window: int, causal: bool = False) -> Array:
    """Dense band mask bool [n, n] of the local pattern (a reference for the blocked form)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    radius = window // 2
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    allowed = jnp.abs(i - j) <= radius
    if causal:
        allowed = allowed & (j <= i)
    return allowed


def _blocks_with_neighbours(x: Array, block: int, reach: int) -> Array:
    """x [B, nb*block, ...] -> [B, nb, (2*reach+1)*block, ...]: each block and neighbours.

    Blocks outside the sequence are zeros (their keys are masked by the caller).
    """
    batch, length = x.shape[:2]
    nb = length // block
    blocks = x.reshape(batch, nb, block, *x.shape[2:])
    if reach == 0:
        return blocks
    pad = [(0, 0)] * blocks.ndim
    pad[1] = (reach, reach)
    padded = jnp.pad(blocks, pad)
    parts = [padded[:, s : s + nb] for s in range(2 * reach + 1)]
    return jnp.concatenate(parts, axis=2)


def local_attention(
    q: Array,
    k: Array,
    v: Array,
    token_mask: Array,
    window: int,
    causal: bool = False,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
) -> tuple[Array, Array]:
    """Blocked sliding-window attention.

    Args:
      q, k, v: [B, n, H, d] (v may have its own last dim).
      token_mask: bool [B, n], True for real tokens.
      window: band width; keys with ``|i - j| <= window // 2`` are attended.
      causal: also require ``j <= i``.

    Returns:
      (out [B, n, H, dv], edges [B]): edges = attended (real query, real key) pairs.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    batch, n, heads, _ = q.shape
    radius = window // 2
    block = max(1, min(radius, n))
    nb = -(-n // block)
    reach = 1 if nb > 1 else 0
    total = nb * block
    token_mask = token_mask.astype(jnp.bool_)
    if total != n:
        extra = total - n
        q, k, v = (jnp.pad(t, ((0, 0), (0, extra), (0, 0), (0, 0))) for t in (q, k, v))
        token_mask = jnp.pad(token_mask, ((0, 0), (0, extra)))
    kb = _blocks_with_neighbours(k, block, reach)  # [B, nb, w, H, d], w = (2 reach + 1) b
    vb = _blocks_with_neighbours(v, block, reach)
    key_real = _blocks_with_neighbours(token_mask, block, reach)  # [B, nb, w]
    width = kb.shape[2]
    q_pos = jnp.arange(total, dtype=jnp.int32).reshape(nb, block)
    k_pos = (jnp.arange(nb, dtype=jnp.int32)[:, None] - reach) * block + jnp.arange(
        width, dtype=jnp.int32
    )[None, :]
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # [nb, b, w]
    band = jnp.abs(diff) <= radius
    if causal:
        band = band & (diff >= 0)
    allowed = band[None] & key_real[:, :, None, :]  # [B, nb, b, w]
    query_real = token_mask.reshape(batch, nb, block)
    edges = jnp.sum(allowed & query_real[..., None], axis=(1, 2, 3), dtype=jnp.float32)
    out = masked_attention(
        q.reshape(batch * nb, block, heads, -1),
        kb.reshape(batch * nb, width, heads, -1),
        vb.reshape(batch * nb, width, heads, -1),
        allowed.reshape(batch * nb, 1, block, width),
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
    )
    out = out.reshape(batch, total, heads, -1)[:, :n]
    return out, edges


def local_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head, ``r = window // 2``, blocks ``b = max(1, min(r, n))``,
    ``nb = ceil(n / b)``, ``kw = 3b`` keys per block (``b`` when ``nb = 1``): ``scale nd``,
    ``scores 2 nb b kw d``, ``softmax 5 nb b kw``, ``aggregation 2 nb b kw d``."""
    r = int(options["window"]) // 2
    b = max(1, min(r, n))
    nb = -(-n // b)
    kw = 3 * b if nb > 1 else b
    return {
        **projection_flops(n, D, H, d),
        "scale": H * n * d,
        "scores": H * 2.0 * nb * b * kw * d,
        "softmax": H * SOFTMAX * nb * b * kw,
        "aggregation": H * 2.0 * nb * b * kw * d,
    }


def local_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections with biases."""
    return projection_params(D, H, d)


@register("local", flops=local_flops, params=local_params)
class LocalAttention(nn.Module):
    """Sliding-window attention: |i - j| <= window // 2 (``causal`` adds j <= i)."""

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    window: int = 64
    causal: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the bad option (the config check calls it too)."""
        check_int("model.attention_options.window", self.window, minimum=0)

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
        """x [B, n, dim], mask [B, n] (True = real) -> [B, n, out_dim]."""
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        self.validate()
        q = head_dense(self.num_heads, self.head_dim, self.dtype, "query")(x)
        k = head_dense(self.num_heads, self.head_dim, self.dtype, "key")(x)
        v = head_dense(self.num_heads, self.head_dim, self.dtype, "value")(x)
        rng = None
        if not deterministic and self.attention_dropout > 0.0:
            rng = self.make_rng("dropout")
        out, edges = local_attention(
            q,
            k,
            v,
            mask,
            self.window,
            self.causal,
            dropout_rate=self.attention_dropout,
            dropout_rng=rng,
            deterministic=deterministic,
        )
        real = jnp.sum(mask, axis=-1, dtype=jnp.float32)
        density = edges / jnp.maximum(real * real, 1.0)
        heads_shape = (x.shape[0], self.num_heads)
        self.sow(STATS_COLLECTION, "density", jnp.broadcast_to(density[:, None], heads_shape))
        self.sow(STATS_COLLECTION, "edges", jnp.broadcast_to(edges[:, None], heads_shape))
        return out_dense(self.out_dim, self.dtype)(out)
