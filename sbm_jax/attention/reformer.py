"""Reformer LSH attention (Kitaev et al. 2020): shared-QK attention within hash buckets.

Per head and hash round:

1. Hash: random rotation R [d, num_buckets/2] (fresh from the ``sample`` rng stream
   when the caller provides it, else from the fixed key ``hash_seed``);
   ``bucket(x) = argmax([x R, -x R])``. With ``num_buckets=1`` every token is in bucket 0.
   Padded tokens get an extra bucket ``num_buckets`` that sorts after all real ones, so
   the order (and hence the chunks) of real tokens never depends on padding (for a given
   ``num_buckets``: its default is computed from the padded length n).
2. Sort tokens by (bucket, position), cut into chunks of ``chunk_len`` and let every
   chunk attend to itself and the previous chunk (circularly, as the reference code's
   ``look_adjacent``; with a single chunk, only itself). The circle closes at the last
   chunk that holds a real token, per example: chunk 0 looks back at that chunk, not at
   trailing chunks of padding, so appending padding changes no real token's output.
3. Shared QK: queries are the projections ``qk``, keys are ``qk / ||qk||``; logits are
   ``q . k / sqrt(d)``. A token's logit to itself is replaced by -1e5, so it attends to
   itself only when it has no other real key in view (the reference behaviour); padded
   keys (and, with ``causal``, future keys) are replaced by -1e9 and get weight 0.
4. The rounds are combined with weights ``softmax_r(lse_r)``, lse_r the log-normaliser
   of round r, which is exact softmax attention over the union of the rounds' keys when
   no key is seen twice (keys seen in several rounds are not de-duplicated, as in the
   HuggingFace implementation).

Memory and time are O(n * chunk_len) per head and round, plus the O(n log n) sort.

Randomness at evaluation: the trainer's evaluation step passes a ``sample`` stream (one
key per evaluation batch, ``training/steps.py``), so evaluation hashes with fresh
rotations per batch, as in training; the fixed ``hash_seed`` rotations are used only
when no ``sample`` stream is given.

Precision: with ``dtype=bfloat16`` the shared QK projection is computed in bf16 and the
buckets are hashed from those bf16 values (cast to float32 only for the rotation), so a
few bucket assignments differ from a float32 model with the same parameters (0.2-0.5%
of them measured, n = 64-4096). A flip moves a token to another chunk and changes the
neighbourhoods of the tokens it passes, so outputs differ far more than the bf16
rounding of attention alone (relative 13% against float32 at n = 64, chunk_len 16,
default buckets; 0.5% with ``num_buckets=1``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import attention_call, check_int, head_dense, out_dense
from sbm_jax.attention.counting import SOFTMAX, projection_flops, projection_params
from sbm_jax.attention.registry import register

Array = jax.Array

SELF_LOGIT = -1e5  # replaces a token's logit to itself (reference: HF/trax)
MASKED_LOGIT = -1e9  # replaces padded / causal-future keys' logits


def default_num_buckets(n: int, chunk_len: int) -> int:
    """About two buckets per chunk: ``max(2, 2 * ceil(n / chunk_len))`` (always even)."""
    return max(2, 2 * (-(-n // chunk_len)))


def lsh_buckets(vectors: Array, rotations: Array) -> Array:
    """Angular LSH buckets.

    Args:
      vectors: [B, n, H, d].
      rotations: [R, H, d, num_buckets // 2] random projections, one per round and head.

    Returns:
      int32 [B, R, H, n] in [0, num_buckets).
    """
    proj = jnp.einsum("bnhd,rhdk->brhnk", vectors.astype(jnp.float32), rotations)
    return jnp.argmax(jnp.concatenate([proj, -proj], axis=-1), axis=-1).astype(jnp.int32)


def _previous_chunks(token_mask: Array, length: int, num_chunks: int) -> tuple[Array, Array]:
    """Each chunk's predecessor, per example: ``(prev [B, nc] int32, distinct [B, nc] bool)``.

    Chunk c > 0 looks back at chunk c - 1. Chunk 0 looks back circularly at the last chunk
    that holds a real token (real tokens sort first), not at the last chunk of the padded
    length: chunks that hold only padding are not part of the circle, so appending padding
    changes no real token's keys. When that last real chunk is chunk 0 itself, chunk 0 has
    no predecessor (``distinct`` False: its look-back keys are masked out), as with a
    single chunk.
    """
    num_real = jnp.sum(token_mask, axis=-1, dtype=jnp.int32)  # [B]
    last_real = jnp.maximum(num_real - 1, 0) // length  # [B]
    chunks = jnp.arange(num_chunks, dtype=jnp.int32)
    prev = jnp.where(chunks[None, :] == 0, last_real[:, None], chunks[None, :] - 1)
    return prev, prev != chunks[None, :]


def _chunk_with_previous(x: Array, prev: Array | None) -> Array:
    """x [B, R, H, nc, L, ...] -> [B, R, H, nc, 2L, ...]: each chunk, then its predecessor
    ``prev [B, nc]`` (:func:`_previous_chunks`); with one chunk (``prev`` None), x itself."""
    if prev is None:
        return x
    before = jax.vmap(lambda xb, pb: jnp.take(xb, pb, axis=2))(x, prev)
    return jnp.concatenate([x, before], axis=4)


def lsh_attention(
    qk: Array,
    v: Array,
    token_mask: Array,
    buckets: Array,
    num_buckets: int,
    chunk_len: int,
    causal: bool = False,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
) -> Array:
    """Shared-QK attention within sorted, chunked hash buckets.

    Args:
      qk: shared query/key projections [B, n, H, d].
      v: values [B, n, H, dv].
      token_mask: bool [B, n], True for real tokens.
      buckets: int [B, R, H, n] in [0, num_buckets), one row per hash round.
      num_buckets: number of buckets (padded tokens go to bucket ``num_buckets``).
      chunk_len: chunk length (clipped to n).
      causal: forbid keys after the query.

    Returns:
      [B, n, H, dv], the rounds combined by their log-normalisers.
    """
    batch, n, heads, d = qk.shape
    rounds = buckets.shape[1]
    if buckets.shape != (batch, rounds, heads, n):
        raise ValueError(f"buckets shape {buckets.shape} must be [B, R, H, n]")
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    length = min(chunk_len, n)
    num_chunks = -(-n // length)
    total = num_chunks * length
    token_mask = token_mask.astype(jnp.bool_)

    # Sort (bucket, position) with padding last: [B, R, H, n] permutation.
    pos = jnp.arange(n, dtype=jnp.int32)
    eff_bucket = jnp.where(token_mask[:, None, None, :], buckets, num_buckets)
    order = jnp.argsort(eff_bucket * n + pos, axis=-1)
    if total != n:  # filler slots: position -1, not real
        order = jnp.pad(order, ((0, 0), (0, 0), (0, 0), (0, total - n)), constant_values=-1)
    slot_pos = order
    gather = jnp.maximum(order, 0)
    slot_real = jnp.take_along_axis(
        jnp.broadcast_to(token_mask[:, None, None, :], eff_bucket.shape), gather, axis=-1
    ) & (order >= 0)

    def sort_heads(x: Array) -> Array:  # [B, n, H, e] -> [B, R, H, total, e]
        xt = jnp.moveaxis(x, 1, 2)[:, None]  # [B, 1, H, n, e]
        xt = jnp.broadcast_to(xt, (batch, rounds, *xt.shape[2:]))
        return jnp.take_along_axis(xt, gather[..., None], axis=3)

    qk32 = qk.astype(jnp.float32)
    keys = qk32 / jnp.maximum(jnp.linalg.norm(qk32, axis=-1, keepdims=True), 1e-6)
    sq = sort_heads(qk32)
    sk = sort_heads(keys)
    sv = sort_heads(v)

    def chunk(x: Array) -> Array:  # [B, R, H, total, ...] -> [B, R, H, nc, L, ...]
        return x.reshape(*x.shape[:3], num_chunks, length, *x.shape[4:])

    prev = None
    if num_chunks > 1:
        prev, distinct = _previous_chunks(token_mask, length, num_chunks)
    cq = chunk(sq)
    ck = _chunk_with_previous(chunk(sk), prev)
    cv = _chunk_with_previous(chunk(sv), prev)
    q_pos = chunk(slot_pos)
    k_pos = _chunk_with_previous(chunk(slot_pos), prev)
    k_real = _chunk_with_previous(chunk(slot_real), prev)
    if prev is not None:  # a chunk that is its own predecessor sees its keys once
        own = jnp.ones((*distinct.shape, length), jnp.bool_)
        seen = jnp.concatenate([own, jnp.broadcast_to(distinct[..., None], own.shape)], -1)
        k_real = k_real & seen[:, None, None]

    logits = jnp.einsum("...qd,...kd->...qk", cq, ck) / jnp.sqrt(jnp.float32(d))
    same = q_pos[..., :, None] == k_pos[..., None, :]
    logits = jnp.where(same, SELF_LOGIT, logits)
    blocked = ~k_real[..., None, :]
    if causal:
        blocked = blocked | (k_pos[..., None, :] > q_pos[..., :, None])
    logits = jnp.where(blocked, MASKED_LOGIT, logits)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - lse)
    if not deterministic and dropout_rate > 0.0:
        if dropout_rate >= 1.0:
            raise ValueError(f"attention_dropout must be < 1, got {dropout_rate}")
        if dropout_rng is None:
            raise ValueError("dropout_rng is required when dropout_rate > 0 and not deterministic")
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("...qk,...kd->...qd", weights.astype(v.dtype), cv)

    # Unsort: [B, R, H, total, dv] -> [B, R, H, n, dv] at the original positions.
    out = out.reshape(batch, rounds, heads, total, -1)
    lse = lse.reshape(batch, rounds, heads, total)
    inverse = jnp.argsort(jnp.where(order >= 0, order, n), axis=-1)[..., :n]
    out = jnp.take_along_axis(out, inverse[..., None], axis=3)
    lse = jnp.take_along_axis(lse, inverse, axis=3)

    round_weights = jax.nn.softmax(lse, axis=1)  # [B, R, H, n]
    combined = jnp.sum(out * round_weights[..., None].astype(out.dtype), axis=1)
    return jnp.moveaxis(combined, 1, 2)  # [B, n, H, dv]


def reformer_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections (2 inputs: shared QK and V); per head, rounds R, chunk
    ``c = min(chunk_len, n)``, ``nc = ceil(n / c)`` chunks, ``w = 2c`` keys per chunk (``c``
    when ``nc = 1``), b buckets: ``hashing R (2nd b/2 + nb)`` (0 when b = 1);
    ``key_norm 3nd``; ``sort R n log2 n``; ``scores R 2 nc c w d``; ``softmax R 5 nc c w``;
    ``aggregation R 2 nc c w d``; ``combine_rounds 5nR + 2nRd``."""
    rounds = int(options["num_hashes"])
    c = min(int(options["chunk_len"]), n)
    nc = -(-n // c)
    w = 2 * c if nc > 1 else c
    buckets = options["num_buckets"]
    if buckets is None:
        buckets = default_num_buckets(n, int(options["chunk_len"]))
    hashing = 0.0 if buckets == 1 else rounds * (2.0 * n * d * buckets / 2 + n * buckets)
    return {
        **projection_flops(n, D, H, d, inputs=2),
        "hashing": H * hashing,
        "key_norm": H * 3.0 * n * d,
        "sort": H * rounds * n * math.log2(max(n, 2)),
        "scores": H * rounds * 2.0 * nc * c * w * d,
        "softmax": H * rounds * SOFTMAX * nc * c * w,
        "aggregation": H * rounds * 2.0 * nc * c * w * d,
        "combine_rounds": H * (SOFTMAX * n * rounds + 2.0 * n * rounds * d),
    }


def reformer_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Shared QK, V and output projections with biases (the rotations are not parameters)."""
    return projection_params(D, H, d, inputs=2)


@register("reformer", flops=reformer_flops, params=reformer_params)
class ReformerAttention(nn.Module):
    """LSH self-attention with shared QK (see the module docstring for the algorithm).

    Options: ``num_hashes`` (rounds, 2), ``chunk_len`` (64), ``num_buckets`` (None =
    ``default_num_buckets(n, chunk_len)``; 1 or an even number), ``causal`` (False),
    ``hash_seed`` (key for the rotations when no ``sample`` rng is given).
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    num_hashes: int = 2
    chunk_len: int = 64
    num_buckets: int | None = None
    causal: bool = False
    hash_seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the bad option (the config check calls it too):
        ``num_hashes`` and ``chunk_len`` ints >= 1, ``num_buckets`` None, 1 or an even
        int >= 2."""
        check_int("model.attention_options.num_hashes", self.num_hashes)
        check_int("model.attention_options.chunk_len", self.chunk_len)
        buckets = self.num_buckets
        if buckets is not None:
            check_int("model.attention_options.num_buckets", buckets)
            if buckets != 1 and buckets % 2:
                raise ValueError(
                    "model.attention_options.num_buckets must be 1 or an even number >= 2, "
                    f"got {buckets}"
                )

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
        n = x.shape[1]
        num_buckets = self.num_buckets
        if num_buckets is None:
            num_buckets = default_num_buckets(n, self.chunk_len)
        qk = head_dense(self.num_heads, self.head_dim, self.dtype, "query_key")(x)
        v = head_dense(self.num_heads, self.head_dim, self.dtype, "value")(x)
        batch = x.shape[0]
        if num_buckets == 1:
            buckets = jnp.zeros((batch, self.num_hashes, self.num_heads, n), jnp.int32)
        else:
            if self.has_rng("sample"):
                key = self.make_rng("sample")
            else:
                key = jax.random.key(self.hash_seed)
            rotations = jax.random.normal(
                key, (self.num_hashes, self.num_heads, self.head_dim, num_buckets // 2)
            )
            buckets = lsh_buckets(qk, rotations)
        rng = None
        if not deterministic and self.attention_dropout > 0.0:
            rng = self.make_rng("dropout")
        out = lsh_attention(
            qk,
            v,
            mask,
            buckets,
            num_buckets,
            self.chunk_len,
            self.causal,
            dropout_rate=self.attention_dropout,
            dropout_rng=rng,
            deterministic=deterministic,
        )
        return out_dense(self.out_dim, self.dtype)(out)
