"""Sparse Transformer patterns and the shared masked-attention helper.

Pattern masks are checked against the formulas of the notes evaluated by explicit
loops; modules against a NumPy dense softmax reference built from those loop masks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention.masked import masked_attention
from sbm_jax.attention.sparse_patterns import (
    SparseFixedAttention,
    SparseStridedAttention,
    fixed_pattern,
    split_heads,
    strided_pattern,
)
from tests.attention_testing import (
    assert_grads_finite_and_traced_once,
    assert_padding_invariant,
    dense_masked_attention,
    dense_out,
    dense_qkv,
    module_inputs,
)

# ---------------------------------------------------------------------------------------
# Loop references, written from the notes' formulas.


def loop_strided(n: int, stride: int, causal: bool) -> np.ndarray:
    a = np.zeros((n, n), bool)
    b = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            if causal:
                # A_i = {t, ..., i}, t = max(0, i - l);  B_i = {j : (i - j) mod l = 0}
                a[i, j] = max(0, i - stride) <= j <= i
                b[i, j] = j <= i and (i - j) % stride == 0
            else:
                a[i, j] = abs(i - j) <= stride
                b[i, j] = (i - j) % stride == 0
    return np.stack([a, b])


def loop_fixed(n: int, stride: int, c: int, causal: bool, offset: int = 0) -> np.ndarray:
    a = np.zeros((n, n), bool)
    b = np.zeros((n, n), bool)
    # {l - c, ..., l - 1}, shifted towards the block start by offset
    cells = {(stride - c - offset + t) % stride for t in range(c)}
    for i in range(n):
        for j in range(n):
            ok = (j <= i) if causal else True
            a[i, j] = ok and math.floor(j / stride) == math.floor(i / stride)
            b[i, j] = ok and (j % stride) in cells
    return np.stack([a, b])


def module_reference(params, x, mask, head_masks):
    """Full module reference: projections, dense masked attention, output projection."""
    q, k, v = dense_qkv(params, x)
    allowed = np.asarray(head_masks)[None] & np.asarray(mask)[:, None, None, :]
    return dense_out(params, dense_masked_attention(q, k, v, allowed))


# ---------------------------------------------------------------------------------------
# Masks against the formulas.


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,stride", [(1, 1), (7, 2), (16, 4), (23, 5), (10, 13)])
def test_strided_pattern_matches_formula(n, stride, causal):
    got = np.asarray(strided_pattern(n, stride, causal))
    np.testing.assert_array_equal(got, loop_strided(n, stride, causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n,stride,c,offset",
    [(1, 1, 1, 0), (16, 4, 1, 0), (23, 5, 2, 0), (20, 6, 3, 3), (12, 4, 4, 0), (9, 4, 2, 3)],
)
def test_fixed_pattern_matches_formula(n, stride, c, offset, causal):
    got = np.asarray(fixed_pattern(n, stride, c, causal, summary_offset=offset))
    np.testing.assert_array_equal(got, loop_fixed(n, stride, c, causal, offset))


def test_fixed_pattern_notes_example():
    # Notes: stride 128, c = 8: positions after 128 see 120..127 (causal, 0-based cells).
    b = np.asarray(fixed_pattern(300, 128, 8, causal=True)[1])
    assert set(np.nonzero(b[200])[0]) == set(range(120, 128))
    assert set(np.nonzero(b[299])[0]) == set(range(120, 128)) | set(range(248, 256))


def test_split_heads():
    a = jnp.asarray(np.eye(4, dtype=bool))
    b = jnp.asarray(np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(split_heads(a, b, 1)[0], np.asarray(a | b))
    three = np.asarray(split_heads(a, b, 3))
    np.testing.assert_array_equal(three, np.stack([a, a, b]))
    four = np.asarray(split_heads(a, b, 4))
    np.testing.assert_array_equal(four, np.stack([a, a, b, b]))


def test_bad_options_name_the_field():
    x, mask = module_inputs(0)
    with pytest.raises(ValueError, match="attention_options.c"):
        SparseFixedAttention(num_heads=2, head_dim=4, out_dim=8, stride=3, c=4).init(
            jax.random.key(0), x, mask, deterministic=True
        )
    with pytest.raises(ValueError, match="attention_options.stride"):
        SparseStridedAttention(num_heads=2, head_dim=4, out_dim=8, stride=0).init(
            jax.random.key(0), x, mask, deterministic=True
        )


# ---------------------------------------------------------------------------------------
# Masked attention helper.


def test_masked_attention_matches_dense_and_zeroes_empty_rows():
    kq, kk, kv, km = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(kq, (2, 5, 3, 4))
    k = jax.random.normal(kk, (2, 6, 3, 4))
    v = jax.random.normal(kv, (2, 6, 3, 2))
    allowed = np.array(jax.random.bernoulli(km, 0.4, (2, 3, 5, 6)))
    allowed[0, 1, 2] = False  # an empty row
    out = masked_attention(q, k, v, jnp.asarray(allowed))
    ref = dense_masked_attention(q, k, v, allowed)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out)[0, 2, 1] == 0.0)
    # Gradients are finite even with empty rows.
    grads = jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(masked_attention(q, k, v, allowed) ** 2), (0, 1, 2))
    )(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    # A 2-D mask broadcasts over batch and heads.
    two_d = allowed[0, 0]
    np.testing.assert_allclose(
        masked_attention(q, k, v, jnp.asarray(two_d)),
        dense_masked_attention(q, k, v, np.broadcast_to(two_d, allowed.shape)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_masked_attention_dropout():
    q = k = v = jnp.ones((1, 4, 1, 2))
    mask = jnp.ones((4, 4), bool)
    base = masked_attention(q, k, v, mask)
    same = masked_attention(q, k, v, mask, dropout_rate=0.5, deterministic=True)
    np.testing.assert_array_equal(base, same)
    dropped = masked_attention(
        q, k, v, mask, dropout_rate=0.5, dropout_rng=jax.random.key(0), deterministic=False
    )
    assert bool(jnp.all(jnp.isfinite(dropped))) and not np.allclose(dropped, base)
    with pytest.raises(ValueError, match="dropout_rng"):
        masked_attention(q, k, v, mask, dropout_rate=0.5, deterministic=False)


# ---------------------------------------------------------------------------------------
# Modules.


def strided_heads(n: int, heads: int, stride: int, causal: bool):
    a, b = loop_strided(n, stride, causal)
    return split_heads(jnp.asarray(a), jnp.asarray(b), heads)


def fixed_heads(n: int, heads: int, stride: int, c: int, distinct: bool = False):
    offsets = [h * c % stride for h in range(max(1, heads // 2))] if distinct else [0]
    a = loop_fixed(n, stride, c, False)[0]
    b = np.stack([loop_fixed(n, stride, c, False, off)[1] for off in offsets])
    return split_heads(jnp.asarray(a), jnp.asarray(b), heads)


MODULES = [
    (SparseStridedAttention, {"stride": 3}, lambda n, h: strided_heads(n, h, 3, False)),
    (
        SparseStridedAttention,
        {"stride": 3, "causal": True},
        lambda n, h: strided_heads(n, h, 3, True),
    ),
    (SparseFixedAttention, {"stride": 4, "c": 2}, lambda n, h: fixed_heads(n, h, 4, 2)),
    (
        SparseFixedAttention,
        {"stride": 4, "c": 1, "distinct_summaries": True},
        lambda n, h: fixed_heads(n, h, 4, 1, distinct=True),
    ),
]


@pytest.mark.parametrize(
    "case,num_heads", [(0, 1), (0, 4), (1, 3), (2, 1), (2, 4), (3, 4)], ids=str
)
def test_module_matches_dense_reference(case, num_heads):
    cls, options, masks = MODULES[case]
    x, mask = module_inputs(0)
    module = cls(num_heads=num_heads, head_dim=4, out_dim=8, **options)
    params = {"params": module.init(jax.random.key(2), x, mask, deterministic=True)["params"]}
    out = module.apply(params, x, mask, deterministic=True)
    ref = module_reference(params, x, mask, masks(x.shape[1], num_heads))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_default_stride_is_round_sqrt_n():
    # round(sqrt(23)) = 5, c = max(1, 5 // 8) = 1
    x, mask = module_inputs(0, n=23, lengths=(23, 15))
    for cls, explicit in [
        (SparseStridedAttention, {"stride": 5}),
        (SparseFixedAttention, {"stride": 5, "c": 1}),
    ]:
        default = cls(num_heads=2, head_dim=4, out_dim=8)
        params = {"params": default.init(jax.random.key(0), x, mask, deterministic=True)["params"]}
        explicit_module = cls(num_heads=2, head_dim=4, out_dim=8, **explicit)
        np.testing.assert_array_equal(
            default.apply(params, x, mask, deterministic=True),
            explicit_module.apply(params, x, mask, deterministic=True),
        )


@pytest.mark.parametrize("cls", [SparseStridedAttention, SparseFixedAttention])
def test_padding_never_influences_real_tokens(cls):
    x, mask = module_inputs(0)
    module = cls(num_heads=2, head_dim=4, out_dim=8, stride=3)
    params = module.init(jax.random.key(3), x, mask, deterministic=True)
    noise = 100.0 * jax.random.normal(jax.random.key(4), x.shape)
    assert_padding_invariant(
        lambda x: module.apply(params, x, mask, deterministic=True), x, mask, noise
    )


@pytest.mark.parametrize("cls", [SparseStridedAttention, SparseFixedAttention])
def test_gradients_finite_stats_and_no_retrace(cls):
    x, mask = module_inputs(0)
    module = cls(num_heads=2, head_dim=4, out_dim=8, attention_dropout=0.1)
    params = {"params": module.init(jax.random.key(5), x, mask, deterministic=True)["params"]}

    def apply(params, x, rng):
        return module.apply(
            params, x, mask, deterministic=False, rngs={"dropout": rng}, mutable=["attention_stats"]
        )

    # Traced once, not once per batch; the stats are those of the last batch.
    stats = assert_grads_finite_and_traced_once(apply, params, x.shape, has_aux=True)
    density = stats["attention_stats"]["density"][0]
    assert density.shape == (2, 2)
    assert bool(jnp.all((density > 0) & (density <= 1)))


def test_registered_by_name_with_options():
    from sbm_jax.attention import build_attention, get_attention

    fields = {"num_heads": 2, "head_dim": 4, "out_dim": 8}
    assert get_attention("sparse_strided") is SparseStridedAttention
    assert get_attention("sparse_fixed") is SparseFixedAttention
    assert build_attention("sparse_fixed", options={"stride": 4, "c": 2}, **fields).c == 2
    assert build_attention("local", options={"window": 8}, **fields).window == 8
    assert build_attention("reformer", options={"chunk_len": 8}, **fields).num_hashes == 2
    with pytest.raises(ValueError, match="attention_options.window"):
        build_attention("sparse_strided", options={"window": 8}, **fields)
