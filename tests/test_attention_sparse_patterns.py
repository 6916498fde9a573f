"""Sparse Transformer patterns and the shared masked-attention helper.

Pattern masks are checked against the formulas of the notes evaluated by explicit
loops; modules against a NumPy dense softmax reference built from those loop masks.
"""

from __future__ import annotations

import math
from functools import partial

import flax.linen as nn
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
    assert_module_ignores_padding,
    assert_no_retracing_across_batches,
    assert_padding_invariant,
    build_module,
    dense_masked_attention,
    dense_out,
    dense_qkv,
    module_grads_with_fully_padded_row,
    module_inputs,
    token_mask,
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

    # Against a float64 reference: the softmax weights over the allowed keys, kept with
    # probability 1 - rate (one Bernoulli per [B, H, n, m] weight, drawn here from the
    # same key) and scaled by 1 / (1 - rate).
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (2, 6, 2, 3)) for kk in ks)
    allowed = np.tril(np.ones((6, 6), bool))
    rate, rng = 0.3, jax.random.key(5)
    got = jax.jit(
        lambda q, k, v: masked_attention(
            q, k, v, jnp.asarray(allowed), dropout_rate=rate, dropout_rng=rng, deterministic=False
        )
    )(q, k, v)
    keep = np.asarray(jax.random.bernoulli(rng, 1.0 - rate, (2, 2, 6, 6)))
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bnhd,bmhd->bhnm", q64, k64) / np.sqrt(3)
    s = np.where(allowed, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w = w / w.sum(axis=-1, keepdims=True) * keep / (1.0 - rate)
    np.testing.assert_allclose(got, np.einsum("bhnm,bmhd->bnhd", w, v64), rtol=1e-5, atol=1e-6)


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
    params = {
        "params": nn.unbox(module.init(jax.random.key(2), x, mask, deterministic=True))["params"]
    }
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
        params = {
            "params": nn.unbox(default.init(jax.random.key(0), x, mask, deterministic=True))[
                "params"
            ]
        }
        explicit_module = cls(num_heads=2, head_dim=4, out_dim=8, **explicit)
        np.testing.assert_array_equal(
            default.apply(params, x, mask, deterministic=True),
            explicit_module.apply(params, x, mask, deterministic=True),
        )


@pytest.mark.parametrize("cls", [SparseStridedAttention, SparseFixedAttention])
def test_padding_never_influences_real_tokens(cls):
    x, mask = module_inputs(0)
    module = cls(num_heads=2, head_dim=4, out_dim=8, stride=3)
    params = nn.unbox(module.init(jax.random.key(3), x, mask, deterministic=True))
    noise = 100.0 * jax.random.normal(jax.random.key(4), x.shape)
    assert_padding_invariant(
        lambda x: module.apply(params, x, mask, deterministic=True), x, mask, noise
    )


@pytest.mark.parametrize("cls", [SparseStridedAttention, SparseFixedAttention])
def test_gradients_finite_stats_and_no_retrace(cls):
    x, mask = module_inputs(0)
    module = cls(num_heads=2, head_dim=4, out_dim=8, attention_dropout=0.1)
    params = {
        "params": nn.unbox(module.init(jax.random.key(5), x, mask, deterministic=True))["params"]
    }

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


# ---------------------------------------------------------------------------------------
# Blocked kernels (the default impl) against the loop reference and the mask impl.

# (module, options, num_heads, n, real lengths). Every pattern, causal or not, with the
# union head (H = 1) and split heads, at lengths that are and are not multiples of l;
# the rest of the grid (odd splits, l = 1, l > n, several B offsets) is slow.
_SLOW = pytest.mark.slow
BLOCKED_CASES = [
    (SparseStridedAttention, {"stride": 4}, 1, 12, (12, 7)),
    (SparseStridedAttention, {"stride": 4}, 2, 13, (13, 6)),
    (SparseStridedAttention, {"stride": 4, "causal": True}, 1, 13, (13, 8)),
    (SparseStridedAttention, {"stride": 4, "causal": True}, 3, 12, (12, 5)),
    (SparseFixedAttention, {"stride": 4, "c": 2}, 1, 13, (13, 6)),
    (SparseFixedAttention, {"stride": 4, "c": 2, "causal": True}, 1, 12, (12, 9)),
    (SparseFixedAttention, {"stride": 4, "c": 1, "distinct_summaries": True}, 4, 13, (13, 10)),
    (SparseFixedAttention, {"stride": 13, "c": 4, "causal": True}, 1, 10, (10, 5)),
    pytest.param(SparseStridedAttention, {"stride": 5}, 4, 23, (23, 11), marks=_SLOW),
    pytest.param(SparseStridedAttention, {"stride": 1}, 1, 5, (5, 3), marks=_SLOW),
    pytest.param(SparseStridedAttention, {"stride": 13}, 2, 10, (10, 4), marks=_SLOW),
    pytest.param(SparseFixedAttention, {"stride": 4, "c": 1}, 2, 12, (12, 7), marks=_SLOW),
    pytest.param(
        SparseFixedAttention, {"stride": 5, "c": 2, "causal": True}, 3, 13, (13, 4), marks=_SLOW
    ),
    pytest.param(
        SparseFixedAttention,
        {"stride": 3, "c": 1, "distinct_summaries": True, "causal": True},
        6,
        12,
        (12, 5),
        marks=_SLOW,
    ),
    pytest.param(SparseFixedAttention, {"stride": 1, "c": 1}, 2, 5, (5, 2), marks=_SLOW),
]


def loop_head_masks(cls, options, n: int, heads: int) -> np.ndarray:
    """bool [H, n, n] from the loop references of the notes' formulas."""
    stride, causal = options["stride"], options.get("causal", False)
    if cls is SparseStridedAttention:
        a, b = loop_strided(n, stride, causal)
        return np.asarray(split_heads(jnp.asarray(a), jnp.asarray(b), heads))
    c = options["c"]
    distinct = options.get("distinct_summaries", False)
    offsets = [h * c % stride for h in range(max(1, heads // 2))] if distinct else [0]
    a = loop_fixed(n, stride, c, causal)[0]
    b = np.stack([loop_fixed(n, stride, c, causal, off)[1] for off in offsets])
    return np.asarray(split_heads(jnp.asarray(a), jnp.asarray(b), heads))


def _case_id(value) -> str | None:
    if isinstance(value, type):
        return value.__name__[6:-9]
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return None


@pytest.mark.parametrize("cls,options,heads,n,lengths", BLOCKED_CASES, ids=_case_id)
def test_blocked_matches_loop_reference_and_mask_impl(cls, options, heads, n, lengths):
    x, mask = module_inputs(0, n=n, lengths=lengths)
    blocked = cls(num_heads=heads, head_dim=4, out_dim=8, **options)
    masked = cls(num_heads=heads, head_dim=4, out_dim=8, impl="mask", **options)
    assert blocked.impl == "blocked"  # the default
    params = {
        "params": nn.unbox(blocked.init(jax.random.key(2), x, mask, deterministic=True))["params"]
    }
    target = jax.random.normal(jax.random.key(9), (2, n, 8))

    def loss_fn(module):
        def loss(params, x):
            out, stats = module.apply(
                params, x, mask, deterministic=True, mutable=["attention_stats"]
            )
            return jnp.sum(out * target), (out, stats["attention_stats"])

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    (_, (out, stats)), grads = loss_fn(blocked)(params, x)
    (_, (out_m, stats_m)), grads_m = loss_fn(masked)(params, x)
    # Outputs: float64 loop reference (padded query rows included).
    ref = module_reference(params, x, mask, loop_head_masks(cls, options, n, heads))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, out_m, rtol=1e-4, atol=1e-5)
    # Gradients for every parameter and the input, against the dense-mask impl.
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_m), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # Stats: the same attended pairs as the dense mask counts.
    for name in ("edges", "density"):
        np.testing.assert_allclose(stats[name][0], stats_m[name][0], rtol=1e-6)


@pytest.mark.parametrize(
    "kind,options",
    [
        ("strided", {"stride": 5}),
        ("strided", {"stride": 5, "causal": True}),
        ("fixed", {"stride": 5, "c": 2}),
        ("fixed", {"stride": 5, "c": 2, "causal": True}),
        ("fixed", {"stride": 4, "c": 1, "distinct_summaries": True}),
    ],
)
@pytest.mark.parametrize("heads", [1, 4])
def test_blocked_edges_match_closed_form_counts(kind, options, heads):
    from sbm_jax.analysis.flops import pattern_edges
    from sbm_jax.attention.sparse_blocked import blocked_pattern_attention

    n = 23
    q = k = v = jnp.ones((1, n, heads, 2))
    _, edges = blocked_pattern_attention(q, k, v, jnp.ones((1, n), bool), kind=kind, **options)
    np.testing.assert_array_equal(edges[0], pattern_edges(kind, n, heads, **options))


def test_blocked_query_without_keys_is_zero_and_lone_key_is_copied():
    from sbm_jax.attention.sparse_blocked import blocked_pattern_attention

    # Fixed, l = 13 > n = 10, c = 4: the B head's summary cells are positions 9..12, so
    # example 0 (10 real tokens) has one summary key (9) and example 1 (5 real) none.
    n = 10
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (2, n, 2, 4)) for key in (kq, kk, kv))
    mask = token_mask(n, (10, 5))

    def run(q, k, v):
        return blocked_pattern_attention(q, k, v, mask, kind="fixed", stride=13, c=4)[0]

    out = np.asarray(run(q, k, v))
    assert np.all(out[1, :, 1] == 0.0)
    np.testing.assert_allclose(out[0, :, 1], np.broadcast_to(v[0, 9, 1], (n, 4)), rtol=1e-6)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize(
    "cls,options,heads",
    [
        (SparseFixedAttention, {"c": 2}, 1),
        (SparseFixedAttention, {"c": 2, "causal": True}, 1),
        (SparseStridedAttention, {}, 1),
        pytest.param(SparseStridedAttention, {"causal": True}, 3, marks=pytest.mark.slow),
        pytest.param(
            SparseFixedAttention,
            {"c": 2, "causal": True, "distinct_summaries": True},
            4,
            marks=pytest.mark.slow,
        ),
    ],
    ids=_case_id,
)
def test_blocked_parts_in_chunks_match_mask(cls, options, heads):
    # Every part through its query groups in chunks (lax.map + checkpoint): one group per
    # chunk (chunk_elements=1), and several groups per chunk with the last chunk padded
    # (400: e.g. 4 of the 6 blocks for the fixed B part of the union head).
    from sbm_jax.attention.masked import mask_density
    from sbm_jax.attention.sparse_blocked import blocked_pattern_attention

    n, stride = 23, 4
    kind = "fixed" if cls is SparseFixedAttention else "strided"
    kq, kk, kv, kg = jax.random.split(jax.random.key(6), 4)
    q, k, v, g = (jax.random.normal(key, (2, n, heads, 4)) for key in (kq, kk, kv, kg))
    mask = token_mask(n, (23, 9))
    heads_mask = loop_head_masks(cls, {"stride": stride, **options}, n, heads)
    allowed = jnp.asarray(heads_mask[None] & np.asarray(mask)[:, None, None, :])
    ref = dense_masked_attention(q, k, v, allowed)
    ref_grads = jax.jit(jax.grad(lambda *a: jnp.sum(g * masked_attention(*a, allowed)), (0, 1, 2)))(
        q, k, v
    )
    _, ref_edges = mask_density(allowed, mask)
    for chunk in (1, 400):

        def loss(q, k, v, chunk=chunk):
            out, edges = blocked_pattern_attention(
                q, k, v, mask, kind=kind, stride=stride, chunk_elements=chunk, **options
            )
            return jnp.sum(g * out), (out, edges)

        (_, (out, edges)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
            q, k, v
        )
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(edges, ref_edges)
        for got, want in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 1])
def test_blocked_dropout_is_unbiased(chunk):
    # Inverted dropout keeps the expectation: the mean over many dropout draws approaches
    # the deterministic output (each weight is kept with prob. 1 - p and scaled by
    # 1 / (1 - p)); a statistical bound of 5 standard errors.
    from sbm_jax.attention.sparse_blocked import blocked_pattern_attention

    n, draws = 11, 400
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(key, (1, n, 1, 4)) for key in (kq, kk, kv))
    mask = token_mask(n, (9,))

    def run(rng, deterministic):
        return blocked_pattern_attention(
            q,
            k,
            v,
            mask,
            kind="fixed",
            stride=3,
            c=1,
            dropout_rate=0.5,
            dropout_rng=rng,
            deterministic=deterministic,
            chunk_elements=chunk,
        )[0]

    base = run(None, True)
    samples = jax.jit(jax.vmap(lambda r: run(r, False)))(jax.random.split(jax.random.key(5), draws))
    assert not np.allclose(samples[0], base)
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(draws)
    assert np.all(np.abs(mean - base) <= 5 * se + 1e-6)


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest array any equation of fn's jaxpr (nested ones too) makes."""
    largest = 0

    def walk(jaxpr):
        nonlocal largest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return largest


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize(
    "cls,options", [(SparseStridedAttention, {}), (SparseFixedAttention, {"causal": True})]
)
def test_blocked_forward_and_backward_have_no_n_by_n_array(cls, options, heads):
    # n = 256, l = 16, batch 2: the dense scores are 2 H n^2 elements; the largest
    # blocked part is the band, 2 n 3l = n^2 / 2.67 for any H (3l + n/l = 64 keys per
    # query in the union head). The mask impl does make the [2, H, n, n] arrays, so the
    # check can fail.
    n = 256
    x, mask = module_inputs(0, n=n, lengths=(n, 100))
    sizes = {}
    for impl in ("blocked", "mask"):
        module = cls(num_heads=heads, head_dim=4, out_dim=8, impl=impl, **options)
        params = jax.eval_shape(
            partial(module.init, deterministic=True), jax.random.key(0), x, mask
        )

        def loss(params, x, module=module):
            return jnp.sum(module.apply(params, x, mask, deterministic=True) ** 2)

        sizes[impl] = _largest_intermediate(jax.grad(loss, argnums=(0, 1)), params, x)
    assert sizes["mask"] >= 2 * heads * n * n
    assert sizes["blocked"] < 2 * n * n // 2


def test_bad_options_fail_before_tracing():
    # Explicit options are checked when the module is built, before any call.
    with pytest.raises(ValueError, match="attention_options.c"):
        SparseFixedAttention(num_heads=2, head_dim=4, out_dim=8, stride=3, c=4)
    with pytest.raises(ValueError, match="attention_options.c"):
        SparseFixedAttention(num_heads=2, head_dim=4, out_dim=8, c=0)
    with pytest.raises(ValueError, match="attention_options.stride"):
        SparseStridedAttention(num_heads=2, head_dim=4, out_dim=8, stride=0)
    with pytest.raises(ValueError, match="attention_options.impl"):
        SparseStridedAttention(num_heads=2, head_dim=4, out_dim=8, impl="dense")
    # c larger than the default stride (round(sqrt(12)) = 3) is found at the call.
    x, mask = module_inputs(0)
    for impl in ("blocked", "mask"):
        with pytest.raises(ValueError, match="attention_options.c"):
            SparseFixedAttention(num_heads=2, head_dim=4, out_dim=8, c=4, impl=impl).init(
                jax.random.key(0), x, mask, deterministic=True
            )


@pytest.mark.parametrize("impl", ["blocked", "mask"])
@pytest.mark.parametrize("name", ["sparse_strided", "sparse_fixed"])
def test_shared_contract_for_both_impls(name, impl):
    module = build_module(name, stride=3, impl=impl)
    assert_module_ignores_padding(module)
    module_grads_with_fully_padded_row(module)
    assert_no_retracing_across_batches(module)
