"""Every mechanism takes flax's MultiHeadAttention call next to today's ``(x, mask)``; a
mask or cross-attention it cannot honour is refused in one line, never dropped."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import build_attention

B, L, D, H, HD = 2, 6, 8, 2, 4


def _setup():
    x = jax.random.normal(jax.random.key(0), (B, L, D))
    mask = jnp.arange(L)[None, :] < jnp.array([[L], [L - 2]])
    layer = build_attention("full", num_heads=H, head_dim=HD, out_dim=D)
    params = layer.init(jax.random.key(1), x, mask, deterministic=True)
    return layer, params, x, mask


def test_key_mask_forms_equal_flax_multihead_attention():
    layer, params, x, mask = _setup()
    # flax's own MultiHeadDotProductAttention has the same query/key/value/out tree.
    ref = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * HD, out_features=D)
    want = ref.apply(nn.unbox(params), x, mask=mask[:, None, None, :], deterministic=True)
    real = np.asarray(mask)[..., None]
    for kwargs in (
        {"mask": mask[:, None, None, :]},
        {"mask": jnp.broadcast_to(mask[:, None, None, :], (B, H, L, L))},
    ):
        got = layer.apply(params, x, x, x, deterministic=True, **kwargs)
        np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5)
    legacy = layer.apply(params, x, mask, deterministic=True)
    np.testing.assert_allclose(np.where(real, legacy, 0), np.where(real, want, 0), atol=1e-5)


def test_unhonourable_masks_and_cross_attention_are_refused():
    layer, params, x, mask = _setup()
    causal = jnp.tril(jnp.ones((L, L), bool))[None, None]
    with pytest.raises(ValueError, match="honours only a key-padding mask"):
        layer.apply(params, x, mask=causal, deterministic=True)
    with pytest.raises(ValueError, match="does not broadcast to"):
        layer.apply(params, x, mask=jnp.ones((B, 3, L, L), bool), deterministic=True)
    with pytest.raises(ValueError, match="cross-attention"):
        layer.apply(params, x, x[:, :4], deterministic=True)
    with pytest.raises(ValueError, match="mask= too"):
        layer.apply(params, x, mask, mask=mask, deterministic=True)
    traced = jax.jit(lambda m: layer.apply(params, x, mask=m, deterministic=True))
    with pytest.raises(ValueError, match="honours only a key-padding mask"):
        traced(jnp.broadcast_to(mask[:, None, None, :], (B, H, L, L)))
