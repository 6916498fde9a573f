"""Linear Transformer attention against its kernel formula computed densely in numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import build_attention, get_attention
from sbm_jax.attention.linear import LinearAttention

B, N, DIM, HEADS, HEAD_DIM, OUT = 3, 7, 6, 2, 4, 5
LENGTHS = np.array([7, 4, 1])


def make_inputs(seed: int = 0, length: int = N):
    x = jax.random.normal(jax.random.key(seed), (B, length, DIM))
    mask = jnp.arange(length)[None, :] < jnp.asarray(np.minimum(LENGTHS, length))[:, None]
    return x, mask


def make_module(**options):
    return build_attention(
        "linear", options=options, num_heads=HEADS, head_dim=HEAD_DIM, out_dim=OUT
    )


def init(module, x, mask):
    return module.init(jax.random.key(1), x, mask, deterministic=True)


def dense_qkv(params, x):
    """Q, K, V [B, n, H, d] in float64 from the module's projection parameters."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    x = np.asarray(x, np.float64)
    return tuple(
        np.einsum("bnc,chd->bnhd", x, p[name]["kernel"]) + p[name]["bias"]
        for name in ("query", "key", "value")
    )


def dense_out(params, y):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["params"])
    return np.einsum("bnhd,hdo->bno", y, p["out"]["kernel"]) + p["out"]["bias"]


def elu_plus_one(x):
    return np.where(x > 0, x + 1.0, np.exp(x))


def test_registered_and_shapes():
    assert get_attention("linear") is LinearAttention
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y = module.apply(params, x, mask, deterministic=True)
    assert y.shape == (B, N, OUT)
    assert y.dtype == jnp.float32


def test_matches_dense_kernel_formula():
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y = module.apply(params, x, mask, deterministic=True)

    q, k, v = dense_qkv(params, x)
    m = np.asarray(mask, np.float64)
    phi_q, phi_k = elu_plus_one(q), elu_plus_one(k)
    # Dense kernel matrix A[b, h, i, j] = phi(q_i) . phi(k_j), padded keys removed.
    a = np.einsum("bihd,bjhd->bhij", phi_q, phi_k) * m[:, None, None, :]
    attn = a / (a.sum(-1, keepdims=True) + 1e-6)
    expected = dense_out(params, np.einsum("bhij,bjhd->bihd", attn, v))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_padding_never_influences_real_tokens():
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y = module.apply(params, x, mask, deterministic=True)
    noise = 100.0 * jax.random.normal(jax.random.key(7), x.shape)
    x2 = jnp.where(mask[..., None], x, noise)
    y2 = module.apply(params, x2, mask, deterministic=True)
    real = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y)[real], np.asarray(y2)[real])


def test_gradients_finite_with_fully_padded_row():
    module = make_module()
    x, mask = make_inputs()
    mask = mask.at[2].set(False)  # one example without any real token
    params = init(module, x, mask)

    def loss(params, x):
        y = module.apply(params, x, mask, deterministic=True)
        return jnp.sum(jnp.where(mask[..., None], y, 0.0) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert float(jnp.abs(grads[0]["params"]["key"]["kernel"]).sum()) > 0


def test_no_retracing_across_batches():
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    traces = []

    @jax.jit
    def forward(params, x, mask):
        traces.append(None)
        return module.apply(params, x, mask, deterministic=True)

    for seed in range(3):
        xs, _ = make_inputs(seed)
        forward(params, xs, jnp.roll(mask, seed, axis=0)).block_until_ready()
    assert len(traces) == 1


def test_bad_option_names_field():
    module = make_module(eps=-1.0)
    x, mask = make_inputs()
    with pytest.raises(ValueError, match="model.attention_options.eps"):
        init(module, x, mask)
    with pytest.raises(ValueError, match="model.attention_options.feature_map"):
        make_module(feature_map="relu")
