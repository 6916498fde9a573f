"""Dense multi-head attention restricted by a boolean mask, shared by pattern mechanisms.

A query row whose mask allows no key outputs exactly zero (the same convention as SBM
attention's rows without sampled edges), so a pattern that leaves a token without keys
never produces a uniform average over keys it may not see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _broadcast_mask(mask: Array, batch: int, heads: int, n: int, m: int) -> Array:
    """Mask [n, m], [H, n, m] or anything broadcastable to [B, H, n, m] -> 4-D mask."""
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean, got dtype {mask.dtype}")
    if mask.ndim == 2:
        mask = mask[None, None]
    elif mask.ndim == 3:
        mask = mask[None]
    if mask.ndim != 4:
        raise ValueError(f"mask must have 2, 3 or 4 dimensions, got shape {mask.shape}")
    target = (batch, heads, n, m)
    for got, want in zip(mask.shape, target, strict=True):
        if got not in (1, want):
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to [B,H,n,m]={target}")
    return mask


def masked_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
) -> Array:
    """Softmax attention of ``q`` over the keys ``mask`` allows, per head.

    Args:
      q: queries [B, n, H, d].
      k: keys [B, m, H, d].
      v: values [B, m, H, dv].
      mask: bool, True where query i may attend to key j; shape [n, m], [H, n, m] or
        broadcastable to [B, H, n, m].
      dropout_rate: dropout on the attention weights (inverted scaling).
      dropout_rng: PRNG key for dropout; needed when ``dropout_rate > 0`` and not
        ``deterministic``.
      deterministic: when True, no dropout.

    Returns:
      [B, n, H, dv]; rows with no allowed key are exactly 0.
    """
    batch, n, heads, d = q.shape
    m = k.shape[1]
    if k.shape[:3] != (batch, m, heads) or k.shape[-1] != d:
        raise ValueError(f"k of shape {k.shape} does not match q of shape {q.shape}")
    if v.shape[:3] != (batch, m, heads):
        raise ValueError(f"v of shape {v.shape} does not match k of shape {k.shape}")
    mask = _broadcast_mask(mask, batch, heads, n, m)
    scale = 1.0 / jnp.sqrt(jnp.asarray(d, jnp.float32))
    # Scores accumulate and stay in float32 (bf16 inputs too): rounding them to bf16
    # before the float32 softmax would cost ~2x the error of jax's own attention.
    logits = jnp.einsum("bnhd,bmhd->bhnm", q, k, preferred_element_type=jnp.float32) * scale
    # A large finite fill (not -inf) keeps fully masked rows free of NaN in the forward
    # pass and the gradient; the `where` below then zeroes those rows exactly.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    if not deterministic and dropout_rate > 0.0:
        if dropout_rate >= 1.0:
            raise ValueError(f"attention_dropout must be < 1, got {dropout_rate}")
        if dropout_rng is None:
            raise ValueError("dropout_rng is required when dropout_rate > 0 and not deterministic")
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bhnm,bmhd->bnhd", weights.astype(v.dtype), v)


def key_padding_mask(token_mask: Array) -> Array:
    """Token mask [B, m] (True = real) -> key mask [B, 1, 1, m] for ``masked_attention``."""
    if token_mask.ndim != 2:
        raise ValueError(f"token_mask must be [batch, length], got shape {token_mask.shape}")
    return token_mask.astype(jnp.bool_)[:, None, None, :]


def pair_mask(token_mask: Array) -> Array:
    """Token mask [B, n] -> [B, 1, n, n]: both query and key are real tokens."""
    token_mask = token_mask.astype(jnp.bool_)
    return token_mask[:, None, :, None] & token_mask[:, None, None, :]


def mask_density(allowed: Array, token_mask: Array) -> tuple[Array, Array]:
    """Edges and density per batch element and head.

    Args:
      allowed: bool [B, H, n, n] (or broadcastable), the (query, key) pairs attended,
        already restricted to real tokens.
      token_mask: bool [B, n], True for real tokens.

    Returns:
      (density [B, H], edges [B, H]): edges / (real queries x real keys).
    """
    batch, n = token_mask.shape
    heads = allowed.shape[1]
    allowed = jnp.broadcast_to(allowed, (batch, heads, n, n)) & pair_mask(token_mask)
    edges = jnp.sum(allowed, axis=(-2, -1), dtype=jnp.float32)
    real = jnp.sum(token_mask, axis=-1, dtype=jnp.float32)
    density = edges / jnp.maximum(real * real, 1.0)[:, None]
    return density, edges
