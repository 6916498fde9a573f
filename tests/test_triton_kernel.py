"""The ``triton`` edge kernel (Pallas, Triton lowering) in Pallas interpret mode on CPU,
against the segment reference and the dense masked reference; the cost model's rules
for unmeasured costs and ``kernel="auto"``.

Interpret mode runs the same kernel body as the GPU, except the dK/dV accumulation,
whose emulated ``atomic_add`` keeps one update per duplicated index (see
:mod:`sbm_jax.kernels.triton`): the blocks below reach the same key from several
virtual rows, so dK/dV are checked with duplicates.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax import dense_masked_attention, edge_attention
from sbm_jax.kernels import cost
from sbm_jax.kernels.triton import triton_edge_attention, triton_mode
from tests.test_kernels import M, N, _edges, _inputs, _mask


def _case(seed, density, extra):
    mask = _mask(seed, density)
    edges = _edges(mask, extra_slots=extra)
    q, k, v, scale, g = _inputs(seed, edges.capacity)
    bias = 0.3 * jax.random.normal(jax.random.PRNGKey(seed + 7), scale.shape)
    return mask, edges, q, k, v, scale, bias, g


def _outputs_and_grads(fn, q, k, v, scale, bias, g, **kw):
    def loss(q, k, v, s, b):
        return jnp.sum(fn(q, k, v, edge_scale=s, edge_bias=b, **kw) * g)

    return jax.jit(
        lambda *a: (
            fn(*a[:3], edge_scale=a[3], edge_bias=a[4], **kw),
            jax.grad(loss, argnums=range(5))(*a),
        )  # fmt: skip
    )(q, k, v, scale, bias)


def test_interpret_forward_and_gradients_match_segment_and_dense():
    # R=4, Vb=4: a query's edges span several virtual rows and blocks, and the 4 virtual
    # rows of a block reach the same keys (M=19 keys, 16 slots per block): dK/dV are
    # scatter-adds with duplicate indices.
    mask, edges, q, k, v, scale, bias, g = _case(1, 0.35, 7)
    e = int(mask.sum())
    cols = np.asarray(edges.cols)[:16]
    assert len(np.unique(cols)) < len(cols), "the first block must repeat a key"

    def tri(q, k, v, **kw):
        return triton_edge_attention(q, k, v, edges, slots_per_row=4, block_rows=4, **kw)

    with triton_mode("interpret"):
        out, grads = _outputs_and_grads(tri, q, k, v, scale, bias, g)
    seg = lambda q, k, v, **kw: edge_attention(q, k, v, edges, **kw)  # noqa: E731
    ref_out, ref = _outputs_and_grads(seg, q, k, v, scale, bias, g)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for name, a, b in zip(("q", "k", "v", "scale", "bias"), grads, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6, err_msg=f"d{name}")
    assert np.all(np.asarray(grads[3])[e:] == 0.0) and np.all(np.asarray(grads[4])[e:] == 0.0)
    empty = np.nonzero(~mask.any(axis=1))[0]
    assert np.all(np.asarray(out)[empty] == 0.0), "rows without edges are exactly 0"

    # Independent reference: the dense masked attention with scale and bias as [n, m].
    rr, cc = np.asarray(edges.rows)[:e], np.asarray(edges.cols)[:e]

    def dense(q, k, v, s, b):
        full = lambda x: jnp.zeros((N, M)).at[rr, cc].set(x[:e])  # noqa: E731
        out = dense_masked_attention(q, k, v, jnp.asarray(mask), scale=full(s), bias=full(b))
        return jnp.sum(out * g)

    dref = jax.jit(jax.grad(dense, argnums=range(3)))(q, k, v, scale, bias)
    for name, a, b in zip("qkv", grads[:3], dref, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6, err_msg=f"dense d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("r,vb", [(1, 1), (8, 2), (None, None)])
def test_interpret_dropout_and_shapes_match_segment(r, vb):
    # Dropout (same keep mask as the segment implementation for the same key), a head
    # dimension that is not a power of two (zero-padded) and several block shapes.
    mask, edges, q, k, v, scale, bias, g = _case(2, 0.4, 5)
    q, k = jnp.concatenate([q, q[:, :1]], 1), jnp.concatenate([k, k[:, :1]], 1)  # d = 5
    kw = dict(dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(9))

    def tri(q, k, v, **kw):
        return triton_edge_attention(q, k, v, edges, slots_per_row=r, block_rows=vb, **kw)

    with triton_mode("interpret"):
        out, grads = _outputs_and_grads(tri, q, k, v, scale, bias, g, **kw)
    seg = lambda q, k, v, **kw: edge_attention(q, k, v, edges, **kw)  # noqa: E731
    ref_out, ref = _outputs_and_grads(seg, q, k, v, scale, bias, g, **kw)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for name, a, b in zip(("q", "k", "v", "scale", "bias"), grads, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6, err_msg=f"d{name}")
    # return_lse: each row's log-normaliser, as the segment implementation returns it
    with triton_mode("interpret"):
        _, lse = jax.jit(lambda q: tri(q, k, v, edge_scale=scale, return_lse=True))(q)
    _, ref_lse = edge_attention(q, k, v, edges, edge_scale=scale, return_lse=True)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)


def test_triton_is_refused_off_gpu_in_one_line():
    mask, edges, q, k, v, *_ = _case(0, 0.3, 2)
    with pytest.raises(ValueError, match=r"kernel='triton' needs an NVIDIA GPU.*'cpu'"):
        edge_attention(q, k, v, edges, impl="triton")
    from sbm_jax.attention.sbm import SBMAttention

    layer = SBMAttention(num_heads=1, head_dim=4, num_clusters=2, kernel="triton")
    with pytest.raises(ValueError, match=r"kernel='triton' needs an NVIDIA GPU.*'cpu'"):
        layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 4)))
    with pytest.raises(ValueError, match="kernel='triton'.*'tpu'"):
        cost.resolve_kernel("triton", "tpu")


def test_unmeasured_costs_are_unknown_and_auto_says_what_it_does():
    n = m = 1000
    caps = (n * m // 64, n * m // 16)
    assert cost.edge_cost("rows", "tpu") is None and cost.edge_cost("triton", "gpu") is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cost._warned.clear()
        assert cost.sparse_buckets_worth_it(caps, n, m, kernel="rows", backend="tpu") == (
            False,
            False,
        )
    assert any("no measured cost on backend 'tpu'" in str(w.message) for w in caught)
    # An explicit slot cost still decides there.
    got = cost.sparse_buckets_worth_it(caps, n, m, kernel="rows", backend="tpu", slot_cost=20.0)
    assert got == (True, False)
    # kernel="auto": the cheapest measured kernel that runs on the backend (on CPU the
    # fused kernel where it builds, see tests/test_fused_kernel.py).
    from sbm_jax.kernels.fused import fused_status

    on_cpu = "fused" if fused_status()[0] else "rows"
    assert cost.resolve_kernel("auto", "cpu") == on_cpu
    assert cost.resolve_kernel("auto", "gpu") == "rows"  # triton unmeasured
    assert cost.resolve_kernel("auto", "tpu") == "rows"  # nothing measured
    saved = dict(cost.EDGE_COST["gpu"])
    try:
        cost.EDGE_COST["gpu"]["triton"] = 3.0
        assert cost.resolve_kernel("auto", "gpu") == "triton"
        cost.EDGE_COST["cpu"]["triton"] = 0.01  # a GPU-only kernel is never auto's on CPU
        assert cost.resolve_kernel("auto", "cpu") == on_cpu
    finally:
        cost.EDGE_COST["gpu"] = saved
        cost.EDGE_COST["cpu"].pop("triton", None)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_layer_core_with_triton_matches_the_dense_reference(monkeypatch, backend):
    # The whole SBM core with kernel="triton" in interpret mode, against the dense
    # reference on the same graphs; traced as on a GPU too (one vmap over the graphs,
    # so the Pallas kernels run under their batching rule).
    import tests.test_accelerator as accel

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(accel, "_needs_gpu", lambda kernel: None)
    with triton_mode("interpret"), jax.default_matmul_precision("highest"):
        accel.test_core_matches_the_dense_reference_per_graph("paper", "sparse", "triton")
