"""Sliding-window attention: the blocked O(n w) form against dense masked attention."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

from sbm_jax.attention.local import LocalAttention, band_mask, local_attention
from tests.attention_testing import (
    assert_grads_finite_and_traced_once,
    assert_padding_invariant,
    dense_masked_attention,
    dense_out,
    dense_qkv,
    module_inputs,
    token_mask,
)


def loop_band(n: int, window: int, causal: bool) -> np.ndarray:
    """|i - j| <= window // 2, and j <= i when causal, by explicit loops."""
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            allowed[i, j] = abs(i - j) <= window // 2 and (j <= i or not causal)
    return allowed


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,window", [(1, 4), (9, 0), (9, 1), (10, 4), (13, 6), (7, 64)])
def test_band_mask_matches_loops(n, window, causal):
    got = jax.jit(band_mask, static_argnums=(0, 1, 2))(n, window, causal)
    np.testing.assert_array_equal(got, loop_band(n, window, causal))


@pytest.mark.parametrize(
    "n,window,causal",
    [
        (9, 0, False),
        (10, 4, False),
        (13, 6, True),
        pytest.param(13, 7, False, marks=pytest.mark.slow),
        (7, 64, False),
    ],
)
def test_blocked_equals_dense_masked_attention(n, window, causal):
    kq, kk, kv = jax.random.split(jax.random.key(n * 100 + window), 3)
    q = jax.random.normal(kq, (2, n, 2, 4))
    k = jax.random.normal(kk, (2, n, 2, 4))
    v = jax.random.normal(kv, (2, n, 2, 3))
    mask = token_mask(n, (n, max(1, n - 4)))
    out, edges = jax.jit(local_attention, static_argnums=(4, 5))(q, k, v, mask, window, causal)
    m = np.asarray(mask)
    allowed = loop_band(n, window, causal)[None] & m[:, None, :]
    ref = dense_masked_attention(q, k, v, allowed[:, None])  # allowed shared by heads
    real = m[..., None, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(edges, (allowed & m[:, :, None]).sum(axis=(1, 2)))


def test_module_matches_reference_and_stats():
    x, mask = module_inputs(0)
    module = LocalAttention(num_heads=2, head_dim=4, out_dim=8, window=4)
    init = jax.jit(lambda k, x, m: module.init(k, x, m, deterministic=True))  # one program
    params = {"params": nn.unbox(init(jax.random.key(1), x, mask))["params"]}
    apply = jax.jit(
        lambda p, x, m: module.apply(p, x, m, deterministic=True, mutable=["attention_stats"])
    )
    out, stats = apply(params, x, mask)
    q, k, v = dense_qkv(params, x)
    m = np.asarray(mask)
    allowed = loop_band(12, 4, False)[None] & m[:, None, :]
    ref = dense_out(params, dense_masked_attention(q, k, v, allowed[:, None]))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    pairs = (allowed & m[:, :, None]).sum(axis=(1, 2))
    expected_density = pairs / m.sum(axis=1) ** 2
    density = stats["attention_stats"]["density"][0]
    np.testing.assert_allclose(density, np.repeat(expected_density[:, None], 2, 1), rtol=1e-6)


def test_padding_never_influences_real_tokens():
    x, mask = module_inputs(0)
    module = LocalAttention(num_heads=2, head_dim=4, out_dim=8, window=6)
    init = jax.jit(lambda k, x, m: module.init(k, x, m, deterministic=True))  # one program
    params = nn.unbox(init(jax.random.key(2), x, mask))
    noise = 50.0 * jax.random.normal(jax.random.key(3), x.shape)
    apply = jax.jit(lambda x: module.apply(params, x, mask, deterministic=True))
    assert_padding_invariant(apply, x, mask, noise)


def test_gradients_finite_and_no_retrace():
    x, mask = module_inputs(0)
    module = LocalAttention(num_heads=2, head_dim=4, out_dim=8, window=4, attention_dropout=0.1)
    init = jax.jit(lambda k, x, m: module.init(k, x, m, deterministic=True))  # one program
    params = {"params": nn.unbox(init(jax.random.key(4), x, mask))["params"]}

    def apply(params, x, rng):
        return module.apply(params, x, mask, deterministic=False, rngs={"dropout": rng})

    assert_grads_finite_and_traced_once(apply, params, x.shape)


def test_negative_window_names_the_field():
    x, mask = module_inputs(0)
    with pytest.raises(ValueError, match="attention_options.window"):
        LocalAttention(num_heads=1, head_dim=4, out_dim=8, window=-1).init(
            jax.random.key(0), x, mask, deterministic=True
        )
