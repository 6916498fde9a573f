"""Performer (FAVOR+) against its explicit kernel formulas and exact softmax attention."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import get_attention
from sbm_jax.attention.performer import PerformerAttention, gaussian_random_features
from tests.attention_testing import (
    DIM,
    HEAD_DIM,
    HEADS,
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
    softmax_attention,
)


def make_module(**options):
    options.setdefault("num_features", 16)
    return build_module("performer", **options)


def kernel_attention(phi_q, phi_k, v, mask):
    """Dense normalised kernel attention: A = phi(Q) phi(K)^T with padded keys removed."""
    a = np.einsum("bihm,bjhm->bhij", phi_q, phi_k) * np.asarray(mask, np.float64)[:, None, None]
    return np.einsum("bhij,bjhd->bihd", a / a.sum(-1, keepdims=True), v)


def features_apply(module):
    """Jitted (params, x, mask, rngs) -> (y, features [m, d] in float64)."""

    @jax.jit
    def apply(params, x, mask, rngs=None):
        y, state = module.apply(
            params, x, mask, deterministic=True, rngs=rngs, mutable=["intermediates"]
        )
        (features,) = state["intermediates"]["features"]
        return y, features

    def run(params, x, mask, rngs=None):
        y, features = apply(params, x, mask, rngs)
        return y, np.asarray(features, np.float64)

    return run


def apply_with_features(module, params, x, mask, rngs=None):
    return features_apply(module)(params, x, mask, rngs)


def test_registered_and_shapes():
    assert get_attention("performer") is PerformerAttention
    x, mask = make_inputs()
    for kernel in ("relu", "softmax"):
        module = make_module(kernel=kernel)
        params = init(module, x, mask)
        assert jit_apply(module, params, x, mask).shape == (B, N, OUT)
    assert make_module().num_features == 16
    assert PerformerAttention.num_features == 256  # the paper's setting by default


def test_orthogonal_features_are_block_orthogonal():
    d, m = 4, 10
    features = jax.jit(gaussian_random_features, static_argnums=(1, 2, 3))
    w = np.asarray(features(jax.random.key(0), m, d, True))
    assert w.shape == (m, d)
    for start in range(0, m, d):
        block = w[start : start + d]
        unit = block / np.linalg.norm(block, axis=1, keepdims=True)
        np.testing.assert_allclose(unit @ unit.T, np.eye(len(block)), atol=1e-5)
    iid = features(jax.random.key(0), m, d, False)
    assert iid.shape == (m, d)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_feature_rows_have_gaussian_second_moment(orthogonal):
    # Rows are marginally N(0, I_d): E|w|^2 = d, Var |w|^2 = 2d.
    d, m = 4, 4096
    features = jax.jit(gaussian_random_features, static_argnums=(1, 2, 3))
    w = np.asarray(features(jax.random.key(3), m, d, orthogonal))
    sq = (w**2).sum(1)
    assert abs(sq.mean() - d) < 5 * np.sqrt(2 * d / m)
    np.testing.assert_allclose(w.mean(0), 0.0, atol=5 / np.sqrt(m))


def test_relu_kernel_matches_explicit_formula():
    eps = 1e-4
    module = make_module(kernel="relu", kernel_epsilon=eps)
    x, mask = make_inputs()
    params = init(module, x, mask)
    y, w = apply_with_features(module, params, x, mask)

    q, k, v = dense_qkv(params, x)
    s = HEAD_DIM**-0.25
    phi_q = np.maximum(np.einsum("bnhd,md->bnhm", q * s, w), 0.0) + eps
    phi_k = np.maximum(np.einsum("bnhd,md->bnhm", k * s, w), 0.0) + eps
    expected = dense_out(params, kernel_attention(phi_q, phi_k, v, mask))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)


def test_softmax_kernel_matches_explicit_formula():
    # eps = 0: the stabilising shifts must cancel exactly against the unshifted formula.
    module = make_module(kernel="softmax", kernel_epsilon=0.0)
    x, mask = make_inputs()
    params = init(module, x, mask)
    y, w = apply_with_features(module, params, x, mask)

    q, k, v = dense_qkv(params, x)
    s = HEAD_DIM**-0.25

    def phi(t):
        t = t * s
        return np.exp(np.einsum("bnhd,md->bnhm", t, w) - 0.5 * (t**2).sum(-1, keepdims=True))

    expected = dense_out(params, kernel_attention(phi(q), phi(k), v, mask))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)


def test_softmax_kernel_approximates_softmax_attention():
    # FAVOR+ is unbiased for exp(q.k / sqrt(d)); its error shrinks like 1/sqrt(m).
    x, mask = make_inputs(scale=0.5)
    errors = {}
    for m in (16, 8192):
        module = make_module(kernel="softmax", kernel_epsilon=0.0, num_features=m)
        params = init(module, x, mask)
        q, k, v = dense_qkv(params, x)
        exact = softmax_attention(q, k, v, mask)
        real = np.asarray(mask)
        err = []
        apply = features_apply(module)  # compiled once for the four seeds
        for seed in range(4):
            y, w = apply(params, x, mask, {"sample": jax.random.key(100 + seed)})
            s = HEAD_DIM**-0.25

            def phi(t, w=w, s=s):
                t = t * s
                proj = np.einsum("bnhd,md->bnhm", t, w)
                return np.exp(proj - 0.5 * (t**2).sum(-1, keepdims=True))

            approx = kernel_attention(phi(q), phi(k), v, mask)
            # The module's output is this approximation pushed through `out`.
            np.testing.assert_allclose(
                np.asarray(y), dense_out(params, approx), rtol=1e-4, atol=1e-5
            )
            err.append(np.abs(approx - exact)[real].mean() / np.abs(exact[real]).mean())
        errors[m] = float(np.mean(err))
    # Measured here: ~0.12 with 16 features, ~0.007 with 8192 (sqrt(8192 / 16) = 22.6).
    assert errors[8192] < 0.03, errors
    assert errors[8192] < errors[16] / 4, errors


def test_redraw_uses_sample_stream_else_fixed_features():
    x, mask = make_inputs()
    module = make_module(redraw=True)
    params = init(module, x, mask)
    fixed_module = make_module(redraw=False)
    # One compiled program per module (and per rngs structure), reused across keys.
    jitted = {
        m: jax.jit(lambda rngs, m=m: m.apply(params, x, mask, deterministic=True, rngs=rngs))
        for m in (module, fixed_module)
    }

    def run(module, rngs=None):
        return np.asarray(jitted[module](rngs))

    a = run(module, {"sample": jax.random.key(5)})
    b = run(module, {"sample": jax.random.key(6)})
    a_again = run(module, {"sample": jax.random.key(5)})
    fixed = run(module)
    np.testing.assert_array_equal(a, a_again)
    assert np.abs(a - b).max() > 1e-4
    np.testing.assert_array_equal(fixed, run(fixed_module))
    np.testing.assert_array_equal(fixed, run(fixed_module, {"sample": jax.random.key(5)}))
    assert np.abs(fixed - a).max() > 1e-4


def test_fixed_features_differ_between_layers():
    class TwoLayers(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            kwargs = dict(num_heads=HEADS, head_dim=HEAD_DIM, out_dim=DIM, num_features=8)
            x = PerformerAttention(**kwargs, name="a")(x, mask, deterministic=True)
            return PerformerAttention(**kwargs, name="b")(x, mask, deterministic=True)

    x, mask = make_inputs()
    model = TwoLayers()
    params = nn.unbox(jax.jit(model.init)(jax.random.key(1), x, mask))
    _, state = jax.jit(lambda p: model.apply(p, x, mask, mutable=["intermediates"]))(params)
    (wa,) = state["intermediates"]["a"]["features"]
    (wb,) = state["intermediates"]["b"]["features"]
    assert np.abs(np.asarray(wa) - np.asarray(wb)).max() > 1e-3


@pytest.mark.parametrize("kernel", ["relu", "softmax"])
def test_padding_never_influences_real_tokens(kernel):
    assert_module_ignores_padding(make_module(kernel=kernel))


@pytest.mark.parametrize("kernel", ["relu", "softmax"])
def test_gradients_finite_with_fully_padded_row(kernel):
    grads = module_grads_with_fully_padded_row(
        make_module(kernel=kernel), rngs={"sample": jax.random.key(2)}
    )
    assert float(jnp.abs(grads[0]["params"]["query"]["kernel"]).sum()) > 0


def test_no_retracing_across_batches():
    assert_no_retracing_across_batches(make_module(kernel="softmax"), rng_stream="sample")


def test_bad_options_name_fields():
    x, mask = make_inputs()
    for options, field in [
        ({"kernel": "exp"}, "kernel"),
        ({"num_features": 0}, "num_features"),
        ({"kernel_epsilon": -1.0}, "kernel_epsilon"),
    ]:
        with pytest.raises(ValueError, match=f"model.attention_options.{field}"):
            init(make_module(**options), x, mask)
