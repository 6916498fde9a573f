"""Linformer against a dense numpy reference built from the same E/F projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import get_attention
from sbm_jax.attention.linformer import LinformerAttention
from tests.attention_testing import (
    DIM,
    OUT,
    B,
    N,
    assert_module_ignores_padding,
    assert_no_retracing_across_batches,
    build_module,
    dense_out,
    dense_qkv,
    init,
    make_inputs,
    module_grads_with_fully_padded_row,
    softmax_attention,
    to64,
)


def make_module(**options):
    options.setdefault("proj_len", 3)
    options.setdefault("max_len", 10)
    return build_module("linformer", **options)


def test_registered_and_shapes():
    assert get_attention("linformer") is LinformerAttention
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    assert params["params"]["proj_k"].shape == (10, 3)
    assert params["params"]["proj_v"].shape == (10, 3)
    assert module.apply(params, x, mask, deterministic=True).shape == (B, N, OUT)
    shared = init(make_module(share_kv=True), x, mask)
    assert "proj_v" not in shared["params"]
    assert LinformerAttention.proj_len == 256  # the paper's setting by default


def test_matches_dense_reference_from_same_projections():
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y = module.apply(params, x, mask, deterministic=True)

    q, k, v = dense_qkv(params, x)
    p = to64(params["params"])
    e, f = p["proj_k"][:N], p["proj_v"][:N]
    m = np.asarray(mask, np.float64)[:, :, None, None]
    # K' = E^T (K with padded rows zeroed), V' = F^T (V likewise), per batch and head.
    k_proj = np.einsum("nk,bnhd->bkhd", e, k * m)
    v_proj = np.einsum("nk,bnhd->bkhd", f, v * m)
    expected = dense_out(params, softmax_attention(q, k_proj, v_proj))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_identity_projections_give_exact_softmax_attention():
    # With proj_len = n and E = F = I, Linformer is full softmax attention.
    n = 5
    module = make_module(proj_len=n, max_len=n)
    x = jax.random.normal(jax.random.key(4), (2, n, DIM))
    mask = jnp.ones((2, n), bool)
    params = init(module, x, mask)
    inner = dict(params["params"], proj_k=jnp.eye(n), proj_v=jnp.eye(n))
    params = {"params": inner}
    y = module.apply(params, x, mask, deterministic=True)

    q, k, v = dense_qkv(params, x)
    expected = dense_out(params, softmax_attention(q, k, v))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_shorter_input_uses_leading_rows_and_longer_input_fails():
    module = make_module()
    x, mask = make_inputs(length=N)
    params = init(module, x, mask)
    short_x, short_mask = make_inputs(length=4)
    assert module.apply(params, short_x, short_mask, deterministic=True).shape == (B, 4, OUT)
    long_x, long_mask = make_inputs(length=11)
    with pytest.raises(ValueError, match=r"model\.attention_options\.max_len=10"):
        module.apply(params, long_x, long_mask, deterministic=True)


def test_padding_never_influences_real_tokens():
    assert_module_ignores_padding(make_module())


def test_attention_dropout_only_when_not_deterministic():
    module = make_module(attention_dropout=0.5)
    plain = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y_eval = module.apply(params, x, mask, deterministic=True)
    np.testing.assert_array_equal(
        np.asarray(y_eval), np.asarray(plain.apply(params, x, mask, deterministic=True))
    )
    rngs = {"dropout": jax.random.key(3)}
    y_train = module.apply(params, x, mask, deterministic=False, rngs=rngs)
    assert np.abs(np.asarray(y_train) - np.asarray(y_eval)).max() > 1e-3


def test_gradients_finite_with_fully_padded_row():
    grads = module_grads_with_fully_padded_row(make_module())
    g_e = np.asarray(grads[0]["params"]["proj_k"])
    assert np.abs(g_e[:N]).sum() > 0
    np.testing.assert_array_equal(g_e[N:], 0.0)  # rows beyond the input length are unused


def test_no_retracing_across_batches():
    assert_no_retracing_across_batches(make_module())


def test_bad_options_name_fields():
    x, mask = make_inputs()
    for options, field in [({"proj_len": 0}, "proj_len"), ({"max_len": 0}, "max_len")]:
        with pytest.raises(ValueError, match=f"model.attention_options.{field}"):
            init(make_module(**options), x, mask)
