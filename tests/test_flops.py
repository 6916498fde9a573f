"""Analytic FLOPs and parameter counts against hand computations and dense references."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sbm_jax.analysis import (
    attention_flops,
    attention_param_count,
    counted_mechanisms,
    flops_table,
    pattern_edges,
)
from sbm_jax.attention import available

SHAPE = dict(emb_dim=8, num_heads=2, head_dim=4)


def test_full_flops_match_the_closed_form():
    n, D, H, d = 6, 8, 2, 4
    costs = attention_flops("full", seq_len=n, **SHAPE)
    # By hand: Q, K, V projections 3 * (2 n D) per output feature H*d; output projection.
    qkv = 3 * 2 * n * D * H * d  # 2304
    out = 2 * n * H * d * D  # 768
    scores = H * 2 * n * n * d  # 576
    aggregation = H * 2 * n * n * d  # 576
    softmax = H * 5 * n * n  # 360
    scale = H * n * d  # 48
    assert costs["qkv_projection"] == qkv == 2304
    assert costs["out_projection"] == out == 768
    assert costs["scores"] == scores == 576
    assert costs["aggregation"] == aggregation
    assert costs["softmax"] == softmax
    assert costs["total"] == qkv + out + scores + aggregation + softmax + scale == 4632


def test_param_counts_match_hand_sums():
    D, H, d = 8, 2, 4
    # full and linear: Q, K, V DenseGeneral (D -> H*d, with bias) and out (H*d -> D, bias).
    hand = 3 * (D * H * d + H * d) + (H * d * D + D)
    assert hand == 3 * (64 + 8) + (64 + 8) == 288
    assert attention_param_count("full", seq_len=6, options={}, **SHAPE) == hand
    assert attention_param_count("linear", seq_len=6, options={}, **SHAPE) == hand
    # Linformer adds two [max_len, proj_len] projections.
    count = attention_param_count(
        "linformer", seq_len=6, options={"proj_len": 3, "max_len": 10}, **SHAPE
    )
    assert count == hand + 2 * 10 * 3


def test_every_registered_mechanism_has_positive_counts():
    assert set(available()) <= set(counted_mechanisms())
    small = {
        "linformer": {"proj_len": 4, "max_len": 16},
        "performer": {"num_features": 8},
        "nystromformer": {"num_landmarks": 4, "conv_kernel_size": 3},
        "sbm": {"num_clusters": 4},
        "local": {"window": 4},
    }
    for name in available():
        opts = small.get(name, {})
        costs = attention_flops(name, seq_len=16, options=opts, density=0.25, **SHAPE)
        assert costs["total"] > 0 and all(v >= 0 for v in costs.values()), name
        assert costs["total"] == pytest.approx(sum(v for k, v in costs.items() if k != "total"))
        assert attention_param_count(name, seq_len=16, options=opts, **SHAPE) > 0, name


def test_sbm_flops_grow_linearly_in_density_and_errors_name_arguments():
    lo = attention_flops("sbm", seq_len=64, density=0.1, **SHAPE)
    hi = attention_flops("sbm", seq_len=64, density=0.2, **SHAPE)
    mid = attention_flops("sbm", seq_len=64, density=0.15, **SHAPE)
    assert mid["total"] == pytest.approx((lo["total"] + hi["total"]) / 2)
    assert hi["scores"] == pytest.approx(2 * lo["scores"])
    with pytest.raises(ValueError, match="density"):
        attention_flops("sbm", seq_len=8, density=1.5, **SHAPE)
    with pytest.raises(ValueError, match="seq_len"):
        attention_flops("full", seq_len=0, **SHAPE)
    with pytest.raises(ValueError, match="nope"):
        attention_flops("nope", seq_len=8, **SHAPE)
    with pytest.raises(ValueError, match="options.bogus"):
        attention_flops("full", seq_len=8, options={"bogus": 1}, **SHAPE)


def _dense_patterns(kind, n, stride, c, causal):
    """Type-A and type-B masks [n, n] straight from the Sparse Transformer notes."""
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")  # [n, n] each
    allowed = (j <= i) if causal else np.ones((n, n), bool)
    if kind == "strided":
        a = (np.abs(i - j) <= stride) & allowed
        b = ((i - j) % stride == 0) & allowed
    else:
        a = (i // stride == j // stride) & allowed
        b = (j % stride >= stride - c) & allowed
    return a, b


@pytest.mark.parametrize("kind", ["strided", "fixed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, stride, c", [(17, 4, 2), (16, 4, 1), (10, 3, 3), (5, 1, 1)])
def test_pattern_edges_match_dense_masks(kind, causal, n, stride, c):
    a, b = _dense_patterns(kind, n, stride, c, causal)
    one = pattern_edges(kind, n, 1, stride=stride, c=c, causal=causal)
    assert one == [int((a | b).sum())]
    three = pattern_edges(kind, n, 3, stride=stride, c=c, causal=causal)
    assert three == [int(a.sum())] * 2 + [int(b.sum())]


def test_local_and_linear_scale_linearly_full_quadratically():
    def attn_only(name, n, **kw):
        c = attention_flops(name, seq_len=n, **SHAPE, **kw)
        return c["total"] - c["qkv_projection"] - c["out_projection"]

    assert attn_only("full", 256) == pytest.approx(4 * attn_only("full", 128), rel=0.02)
    assert attn_only("linear", 256) == pytest.approx(2 * attn_only("linear", 128))
    local = {"options": {"window": 8}}
    assert attn_only("local", 256, **local) == pytest.approx(2 * attn_only("local", 128, **local))


def test_flops_table_rows():
    rows = flops_table(["full", "linear"], seq_lens=(32,), emb_dim=8, num_heads=2, head_dim=4)
    assert [r["mechanism"] for r in rows] == ["full", "linear"]
    assert rows[0]["relative_to_full"] == 1.0
    assert rows[0]["params"] == 288
    assert rows[1]["attention_flops"] < rows[0]["attention_flops"]


def _xla_flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def test_nystromformer_pinv_flops_match_xla_cost_analysis():
    """One iteration of the iterative pseudo-inverse does 4 m x m products (8 m^3), as
    XLA's own count of the compiled iterative_pinv says (iterations 1 minus 0; XLA counts
    a loop body once, so more iterations cannot be read from it)."""
    from sbm_jax.attention.nystromformer import iterative_pinv

    m = 128
    a = jax.nn.softmax(jax.random.normal(jax.random.key(0), (m, m)), axis=-1)

    def analytic(iters: int) -> float:
        options = dict(num_landmarks=m, pinv_iterations=iters, conv_kernel_size=0)
        # n = 2m: segments of two tokens, m landmarks (n <= m would be exact attention).
        return attention_flops("nystromformer", seq_len=2 * m, options=options, **SHAPE)["pinv"]

    xla = [_xla_flops(lambda a, i=i: iterative_pinv(a, i), a) for i in (0, 1)]
    heads = SHAPE["num_heads"]
    per_iteration = (analytic(1) - analytic(0)) / heads
    assert per_iteration == 8 * m**3 + 4 * m**2
    np.testing.assert_allclose(per_iteration, xla[1] - xla[0], rtol=0.02)
    np.testing.assert_allclose(analytic(1) / heads, xla[1], rtol=0.02)


def test_nystromformer_flops_without_fewer_landmarks_are_exact_attention():
    """n <= num_landmarks runs exact softmax attention: full attention's closed form
    (test_full_flops_match_the_closed_form), plus the scaling of K as well as Q."""
    n, H, d = 6, 2, 4
    options = dict(num_landmarks=n, pinv_iterations=6, conv_kernel_size=0)
    nys = attention_flops("nystromformer", seq_len=n, options=options, **SHAPE)
    assert nys["pinv"] == nys["landmarks"] == 0
    assert nys["total"] == 4632 + H * n * d
