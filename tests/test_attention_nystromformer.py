"""Nystromformer: exact softmax attention with landmarks = n, plus its parts vs numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention import get_attention
from sbm_jax.attention.nystromformer import (
    NystromformerAttention,
    iterative_pinv,
    segment_landmarks,
)
from tests.attention_testing import (
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
    softmax,
    softmax_attention,
)


def make_module(**options):
    options.setdefault("num_landmarks", 3)
    options.setdefault("conv_kernel_size", 3)
    return build_module("nystromformer", **options)


def test_registered_and_shapes():
    assert get_attention("nystromformer") is NystromformerAttention
    module = make_module()
    x, mask = make_inputs()
    params = init(module, x, mask)
    assert jit_apply(module, params, x, mask).shape == (B, N, OUT)
    assert params["params"]["value_conv"]["kernel"].shape == (3, 1, 1, HEADS)
    no_conv = init(make_module(conv_kernel_size=0), x, mask)
    assert "value_conv" not in no_conv["params"]
    defaults = NystromformerAttention(num_heads=1, head_dim=1, out_dim=1)
    assert (defaults.num_landmarks, defaults.pinv_iterations, defaults.conv_kernel_size) == (
        256,
        6,
        35,
    )


def test_iterative_pinv_converges_to_inverse():
    rng = np.random.default_rng(0)
    a = softmax(rng.normal(size=(2, 6, 6)))  # row-stochastic, condition numbers ~ 10-100
    pinv = jax.jit(iterative_pinv, static_argnums=1)
    got = np.asarray(pinv(jnp.asarray(a, jnp.float32), 20))
    want = np.linalg.inv(a)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    # A well-conditioned matrix is inverted by the reference's 6 iterations.
    b = softmax(4.0 * np.eye(5) + 0.3 * rng.normal(size=(5, 5)))
    got6 = np.asarray(pinv(jnp.asarray(b, jnp.float32), 6))
    np.testing.assert_allclose(got6, np.linalg.inv(b), atol=1e-4)


def test_segment_landmarks_are_means_of_real_tokens():
    rng = np.random.default_rng(1)
    n, m = 10, 4  # segments of 3: [0-2] [3-5] [6-8] [9 + 2 padding]
    x = rng.normal(size=(2, 1, n, 3))
    mask = np.ones((2, n), bool)
    mask[1, 3:6] = False  # second example: one empty segment
    mask[1, 9] = False  # and an empty tail segment
    landmarks = jax.jit(segment_landmarks, static_argnums=2)
    got, got_mask = landmarks(jnp.asarray(x, jnp.float32), jnp.asarray(mask), m)
    got, got_mask = np.asarray(got), np.asarray(got_mask)
    for b in range(2):
        for s in range(m):
            idx = [i for i in range(3 * s, min(3 * s + 3, n)) if mask[b, i]]
            assert bool(got_mask[b, s]) == bool(idx)
            want = x[b, :, idx].mean(0) if idx else np.zeros((1, 3))
            np.testing.assert_allclose(got[b, :, s], want, atol=1e-6)


def test_landmarks_equal_length_is_exact_softmax_attention():
    # Segments of one token: the three kernels are the attention matrix A itself and
    # A pinv(A) A V = A V (enough pseudo-inverse iterations; no convolution).
    module = make_module(num_landmarks=N, conv_kernel_size=0, pinv_iterations=30)
    x, mask = make_inputs(scale=2.0)
    params = init(module, x, mask)
    y = np.asarray(jit_apply(module, params, x, mask))

    q, k, v = dense_qkv(params, x)
    expected = dense_out(params, softmax_attention(q, k, v, mask))
    real = np.asarray(mask)
    np.testing.assert_allclose(y[real], expected[real], rtol=1e-4, atol=2e-4)
    # More landmarks than tokens is the same computation (landmarks are capped at n).
    more = make_module(num_landmarks=4 * N, conv_kernel_size=0, pinv_iterations=30)
    np.testing.assert_allclose(np.asarray(jit_apply(more, params, x, mask)), y)


@pytest.mark.parametrize("n, landmarks", [(128, 256), (64, 64)])
def test_no_fewer_landmarks_than_tokens_is_exact_with_default_iterations(n, landmarks):
    """n <= num_landmarks is computed as exact softmax attention (the reference code's
    rule): with the default 6 pseudo-inverse iterations the approximation was off by a
    relative 1.4e-2 at n = 128, 256 landmarks. Checked against a float64 numpy softmax
    over the real keys, with padded examples."""
    from sbm_jax.attention.nystromformer import nystrom_attention

    batch, heads, d = 2, 2, 32
    ks = jax.random.split(jax.random.key(n), 3)
    q, k, v = (2.0 * jax.random.normal(kk, (batch, n, heads, d)) for kk in ks)
    mask = jnp.arange(n)[None, :] < jnp.asarray([n, n // 2 + 3])[:, None]
    out = jax.jit(lambda q, k, v, m: nystrom_attention(q, k, v, m, landmarks))(q, k, v, mask)
    q64, k64, v64 = (np.asarray(t, np.float64) for t in (q, k, v))
    m = np.asarray(mask)
    logits = np.einsum("bihd,bjhd->bhij", q64, k64) / np.sqrt(d)
    logits = np.where(m[:, None, None, :], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expected = np.einsum("bhij,bjhd->bihd", w, v64)
    np.testing.assert_allclose(np.asarray(out)[m], expected[m], rtol=1e-4, atol=1e-4)


def dense_nystrom(q, k, v, mask, num_landmarks):
    """Per example and head: landmarks from the non-empty segments only, numpy pinv."""
    batch, n, heads, d = q.shape
    seg = -(-n // num_landmarks)
    out = np.zeros_like(v)
    for b in range(batch):
        real = np.flatnonzero(mask[b])
        groups = [[i for i in real if i // seg == s] for s in range(-(-n // seg))]
        groups = [g for g in groups if g]
        for h in range(heads):
            qs, ks = q[b, :, h] * d**-0.25, k[b, :, h] * d**-0.25
            q_land = np.stack([qs[g].mean(0) for g in groups])
            k_land = np.stack([ks[g].mean(0) for g in groups])
            kernel_1 = softmax(qs @ k_land.T)
            kernel_2 = softmax(q_land @ k_land.T)
            kernel_3 = softmax(q_land @ ks[real].T)
            out[b, :, h] = kernel_1 @ np.linalg.pinv(kernel_2) @ kernel_3 @ v[b, real, h]
    return out


def test_fewer_landmarks_match_dense_nystrom_reference():
    # n = 10 with 4 landmarks: segments of 3, the last one padded; the short examples
    # also have segments without any real token.
    n = 10
    module = make_module(num_landmarks=4, conv_kernel_size=0, pinv_iterations=40)
    x, mask = make_inputs(length=n, scale=2.0)
    params = init(module, x, mask)
    y = np.asarray(jit_apply(module, params, x, mask))
    q, k, v = dense_qkv(params, x)
    expected = dense_out(params, dense_nystrom(q, k, v, np.asarray(mask), 4))
    real = np.asarray(mask)
    np.testing.assert_allclose(y[real], expected[real], rtol=1e-4, atol=2e-4)
    # 8 landmarks over 10 tokens: segments of 2, so only 5 landmarks exist.
    eight = make_module(num_landmarks=8, conv_kernel_size=0, pinv_iterations=40)
    y8 = np.asarray(jit_apply(eight, params, x, mask))
    expected8 = dense_out(params, dense_nystrom(q, k, v, np.asarray(mask), 8))
    np.testing.assert_allclose(y8[real], expected8[real], rtol=1e-4, atol=2e-4)


def test_value_convolution_skip_matches_numpy():
    size = 3
    with_conv = make_module(conv_kernel_size=size)
    without = make_module(conv_kernel_size=0)
    x, mask = make_inputs()
    params = init(with_conv, x, mask)
    inner = dict(params["params"])
    kernel = np.asarray(inner.pop("value_conv")["kernel"], np.float64)[:, 0, 0, :]  # [k, H]
    diff = np.asarray(jit_apply(with_conv, params, x, mask)) - np.asarray(
        jit_apply(without, {"params": inner}, x, mask)
    )
    _, _, v = dense_qkv(params, x)
    v = v * np.asarray(mask, np.float64)[:, :, None, None]
    half = (size - 1) // 2
    conv = np.zeros_like(v)
    for i in range(N):
        for t in range(size):
            j = i + t - half
            if 0 <= j < N:
                conv[:, i] += kernel[t][None, :, None] * v[:, j]
    np.testing.assert_allclose(diff, dense_out(params, conv, bias=False), atol=1e-5)


@pytest.mark.parametrize("landmarks", [3, 2])
def test_padding_never_influences_real_tokens(landmarks):
    # n = 7 is not divisible by 3 or 2: the tail segment is padded.
    y = assert_module_ignores_padding(make_module(num_landmarks=landmarks, conv_kernel_size=3))
    assert np.all(np.isfinite(np.asarray(y)))


def test_gradients_finite_with_fully_padded_row():
    grads = module_grads_with_fully_padded_row(
        make_module(attention_dropout=0.1),
        deterministic=False,
        rngs={"dropout": jax.random.key(2)},
    )
    assert float(jnp.abs(grads[0]["params"]["key"]["kernel"]).sum()) > 0
    assert float(jnp.abs(grads[0]["params"]["value_conv"]["kernel"]).sum()) > 0


def test_no_retracing_across_batches():
    assert_no_retracing_across_batches(make_module())


def test_bad_options_name_fields():
    x, mask = make_inputs()
    for options, field in [
        ({"num_landmarks": 0}, "num_landmarks"),
        ({"pinv_iterations": -1}, "pinv_iterations"),
        ({"conv_kernel_size": -2}, "conv_kernel_size"),
    ]:
        with pytest.raises(ValueError, match=f"model.attention_options.{field}"):
            init(make_module(**options), x, mask)
