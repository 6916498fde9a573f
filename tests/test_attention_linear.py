"""Linear Transformer attention against its kernel formula computed densely in numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import get_attention
from sbm_jax.attention.linear import LinearAttention
from tests.attention_testing import (
    OUT,
    B,
    N,
    assert_module_ignores_padding,
    assert_no_retracing_across_batches,
    build_module,
    dense_out,
    dense_qkv,
    init,
    jit_apply,
    make_inputs,
    module_grads_with_fully_padded_row,
)


def make_module(**options):
    return build_module("linear", **options)


def elu_plus_one(x):
    return np.where(x > 0, x + 1.0, np.exp(x))


def test_registered_and_shapes():
    assert get_attention("linear") is LinearAttention
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y = jit_apply(module, params, x, mask)
    assert y.shape == (B, N, OUT)
    assert y.dtype == jnp.float32


def test_matches_dense_kernel_formula():
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    y = jit_apply(module, params, x, mask)

    q, k, v = dense_qkv(params, x)
    m = np.asarray(mask, np.float64)
    phi_q, phi_k = elu_plus_one(q), elu_plus_one(k)
    # Dense kernel matrix A[b, h, i, j] = phi(q_i) . phi(k_j), padded keys removed.
    a = np.einsum("bihd,bjhd->bhij", phi_q, phi_k) * m[:, None, None, :]
    attn = a / (a.sum(-1, keepdims=True) + 1e-6)
    expected = dense_out(params, np.einsum("bhij,bjhd->bihd", attn, v))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_padding_never_influences_real_tokens():
    assert_module_ignores_padding(make_module())


def test_gradients_finite_with_fully_padded_row():
    grads = module_grads_with_fully_padded_row(make_module())
    assert float(jnp.abs(grads[0]["params"]["key"]["kernel"]).sum()) > 0


def test_no_retracing_across_batches():
    assert_no_retracing_across_batches(make_module())


def test_bad_option_names_field():
    module = make_module(eps=-1.0)
    x, mask = make_inputs()
    with pytest.raises(ValueError, match="model.attention_options.eps"):
        init(module, x, mask)
    with pytest.raises(ValueError, match="model.attention_options.feature_map"):
        make_module(feature_map="relu")
