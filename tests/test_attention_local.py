"""Sliding-window attention: the blocked O(n w) form against dense masked attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention.local import LocalAttention, band_mask, local_attention


def loop_band(n: int, window: int, causal: bool) -> np.ndarray:
    """|i - j| <= window // 2, and j <= i when causal, by explicit loops."""
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            allowed[i, j] = abs(i - j) <= window // 2 and (j <= i or not causal)
    return allowed


def dense_reference(q, k, v, allowed):
    """NumPy softmax attention; q,k,v [B,n,H,d], allowed [B,n,n] (shared by heads)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    batch, n, heads, d = q.shape
    out = np.zeros((batch, n, heads, v.shape[-1]))
    for bi in range(batch):
        for h in range(heads):
            for i in range(n):
                keys = np.nonzero(allowed[bi, i])[0]
                if keys.size == 0:
                    continue
                s = k[bi, keys, h] @ q[bi, i, h] / math.sqrt(d)
                w = np.exp(s - s.max())
                out[bi, i, h] = (w / w.sum()) @ v[bi, keys, h]
    return out


def token_mask(n: int, lengths) -> jax.Array:
    return jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,window", [(1, 4), (9, 0), (9, 1), (10, 4), (13, 6), (7, 64)])
def test_band_mask_matches_loops(n, window, causal):
    np.testing.assert_array_equal(band_mask(n, window, causal), loop_band(n, window, causal))


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
    ref = dense_reference(q, k, v, allowed)
    real = m[..., None, None]
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(edges, (allowed & m[:, :, None]).sum(axis=(1, 2)))


def module_inputs(n=12, lengths=(12, 7)):
    x = jax.random.normal(jax.random.key(0), (2, n, 8))
    return x, token_mask(n, lengths)


def test_module_matches_reference_and_stats():
    x, mask = module_inputs()
    module = LocalAttention(num_heads=2, head_dim=4, out_dim=8, window=4)
    params = {"params": module.init(jax.random.key(1), x, mask, deterministic=True)["params"]}
    out, stats = module.apply(params, x, mask, deterministic=True, mutable=["attention_stats"])
    p = params["params"]
    xd = np.asarray(x, np.float64)
    q, k, v = (
        np.einsum("bnx,xhd->bnhd", xd, p[name]["kernel"]) + p[name]["bias"]
        for name in ("query", "key", "value")
    )
    m = np.asarray(mask)
    allowed = loop_band(12, 4, False)[None] & m[:, None, :]
    att = dense_reference(q, k, v, allowed)
    ref = np.einsum("bnhd,hdo->bno", att, p["out"]["kernel"]) + p["out"]["bias"]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    pairs = (allowed & m[:, :, None]).sum(axis=(1, 2))
    expected_density = pairs / m.sum(axis=1) ** 2
    density = stats["attention_stats"]["density"][0]
    np.testing.assert_allclose(density, np.repeat(expected_density[:, None], 2, 1), rtol=1e-6)


def test_padding_never_influences_real_tokens():
    x, mask = module_inputs()
    module = LocalAttention(num_heads=2, head_dim=4, out_dim=8, window=6)
    params = module.init(jax.random.key(2), x, mask, deterministic=True)
    x2 = jnp.where(mask[..., None], x, 50.0 * jax.random.normal(jax.random.key(3), x.shape))
    apply = jax.jit(lambda x: module.apply(params, x, mask, deterministic=True))
    m = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(apply(x))[m], np.asarray(apply(x2))[m])


def test_gradients_finite_and_no_retrace():
    x, mask = module_inputs()
    module = LocalAttention(num_heads=2, head_dim=4, out_dim=8, window=4, attention_dropout=0.1)
    params = {"params": module.init(jax.random.key(4), x, mask, deterministic=True)["params"]}
    traces = []

    def loss(params, x, rng):
        traces.append(1)
        y = module.apply(params, x, mask, deterministic=False, rngs={"dropout": rng})
        return jnp.sum(y**2)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for seed in range(2):
        xb = jax.random.normal(jax.random.key(10 + seed), x.shape)
        gp, gx = grad_fn(params, xb, jax.random.key(seed))
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(gp))
        assert bool(jnp.all(jnp.isfinite(gx)))
    assert len(traces) == 1


def test_negative_window_names_the_field():
    x, mask = module_inputs()
    with pytest.raises(ValueError, match="attention_options.window"):
        LocalAttention(num_heads=1, head_dim=4, out_dim=8, window=-1).init(
            jax.random.key(0), x, mask, deterministic=True
        )
