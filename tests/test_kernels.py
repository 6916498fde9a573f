"""Fast edge kernels against the segment reference, the dense reference and numpy loops."""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax import EdgeList, dense_masked_attention, edge_attention
from sbm_jax.kernels import (
    KERNEL_BACKENDS,
    KERNELS,
    default_block_slots,
    row_blocks,
    rows_edge_attention,
)

N, M, D, DV = 23, 19, 4, 3


def _edges(mask: np.ndarray, extra_slots: int) -> EdgeList:
    rows, cols = np.nonzero(mask)  # row-major: sorted by (row, col), unique
    e, cap = len(rows), len(rows) + extra_slots
    return EdgeList(
        rows=jnp.asarray(
            np.concatenate([rows, np.full(extra_slots, mask.shape[0] - 1)]), jnp.int32
        ),
        cols=jnp.asarray(np.concatenate([cols, np.arange(extra_slots) % mask.shape[1]]), jnp.int32),
        valid=jnp.asarray(np.arange(cap) < e),
        probs=jnp.asarray(np.zeros(cap, np.float32)),
    )


def _mask(seed: int, density: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mask = rng.random((N, M)) < density
    mask[1] = False  # empty rows, one at the start, a run in the middle, the last one
    mask[7:10] = False
    mask[-1] = False
    mask[4] = True  # a full row: spans many virtual rows when R is small
    return mask


def _inputs(seed: int, cap: int):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (N, D))
    k = jax.random.normal(ks[1], (M, D))
    v = jax.random.normal(ks[2], (M, DV))
    scale = jax.random.uniform(ks[3], (cap,), minval=0.5, maxval=1.5)
    g = jax.random.normal(ks[4], (N, DV))
    return q, k, v, scale, g


def _naive(q, k, v, edges: EdgeList, scale) -> np.ndarray:
    # float64 loops over the valid slots of each row.
    q, k, v, scale = (np.asarray(a, np.float64) for a in (q, k, v, scale))
    rows, cols, ok = (np.asarray(a) for a in (edges.rows, edges.cols, edges.valid))
    out = np.zeros((q.shape[0], v.shape[1]))
    for i in range(q.shape[0]):
        sel = np.nonzero(ok & (rows == i))[0]
        if len(sel) == 0:
            continue
        s = np.array([q[i] @ k[cols[e]] / np.sqrt(q.shape[1]) * scale[e] for e in sel])
        w = np.exp(s - s.max())
        out[i] = (w / w.sum()) @ v[cols[sel]]
    return out


# (slots_per_row, block_slots): one virtual row per block, rows split across virtual
# rows and blocks, several rows per block, the largest block, and the defaults.
CONFIGS = [(1, 1), (3, 5), (8, 16), (None, 2**14), (None, None)]


@pytest.mark.parametrize("r,bs", CONFIGS)
def test_forward_matches_naive_and_dense(r, bs):
    mask = _mask(0, 0.3)
    edges = _edges(mask, extra_slots=11)
    q, k, v, scale, _ = _inputs(0, edges.capacity)
    rows = partial(rows_edge_attention, slots_per_row=r, block_slots=bs)

    @jax.jit  # one program, not op-by-op compiles
    def run(q, k, v, edges, scale, mask):
        out = rows(q, k, v, edges, edge_scale=scale)
        return out, dense_masked_attention(q, k, v, mask), rows(q, k, v, edges)

    out, dense, plain = run(q, k, v, edges, scale, jnp.asarray(mask))
    np.testing.assert_allclose(out, _naive(q, k, v, edges, scale), atol=2e-6)
    np.testing.assert_allclose(plain, dense, atol=2e-6)
    empty = np.nonzero(~mask.any(axis=1))[0]
    assert len(empty) >= 5 and np.all(np.asarray(out)[empty] == 0.0), "empty rows are exactly 0"


@pytest.mark.parametrize("r,bs", CONFIGS)
def test_gradients_match_segment_and_dense(r, bs):
    mask = _mask(1, 0.35)
    edges = _edges(mask, extra_slots=7)
    q, k, v, scale, g = _inputs(1, edges.capacity)
    e = int(mask.sum())

    def loss(impl_fn):
        return lambda q, k, v, s: jnp.sum(impl_fn(q, k, v, s) * g)

    rows_fn = lambda q, k, v, s: rows_edge_attention(
        q, k, v, edges, edge_scale=s, slots_per_row=r, block_slots=bs
    )
    seg_fn = lambda q, k, v, s: edge_attention(q, k, v, edges, edge_scale=s)
    got = jax.jit(jax.grad(loss(rows_fn), argnums=(0, 1, 2, 3)))(q, k, v, scale)
    ref = jax.jit(jax.grad(loss(seg_fn), argnums=(0, 1, 2, 3)))(q, k, v, scale)
    for name, a, b in zip("qkvs", got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6, err_msg=f"d{name}")
    assert np.all(np.asarray(got[3])[e:] == 0.0), "empty slots get exactly zero gradient"

    # Independent reference: the dense masked attention with the scale as an [n, m] matrix.
    rr, cc = np.asarray(edges.rows)[:e], np.asarray(edges.cols)[:e]

    def dense_fn(q, k, v, s):
        full = jnp.zeros((N, M)).at[rr, cc].set(s[:e])
        return dense_masked_attention(q, k, v, jnp.asarray(mask), scale=full)

    dref = jax.jit(jax.grad(loss(dense_fn), argnums=(0, 1, 2, 3)))(q, k, v, scale)
    for name, a, b in zip("qkv", got[:3], dref[:3], strict=False):
        np.testing.assert_allclose(a, b, atol=3e-6, err_msg=f"dense d{name}")
    np.testing.assert_allclose(np.asarray(got[3])[:e], np.asarray(dref[3])[:e], atol=3e-6)


def test_dropout_matches_segment_with_the_same_key():
    mask = _mask(2, 0.4)
    edges = _edges(mask, extra_slots=5)
    q, k, v, scale, g = _inputs(2, edges.capacity)
    kw = dict(edge_scale=scale, dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(9))

    def loss(impl):
        return lambda q, k, v: jnp.sum(edge_attention(q, k, v, edges, impl=impl, **kw) * g)

    # One program per implementation (not op-by-op compiles): output and gradients.
    run = jax.jit(
        lambda q, k, v, impl: (
            edge_attention(q, k, v, edges, impl=impl, **kw),
            jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v),
        ),
        static_argnums=3,
    )
    (out_rows, got), (out_seg, ref) = run(q, k, v, "rows"), run(q, k, v, "segment")
    np.testing.assert_allclose(out_rows, out_seg, atol=2e-6)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6)

    # Independent reference: dense masked attention whose softmax weights are kept with
    # probability 1 - rate and scaled by 1 / (1 - rate), with the slots' keep mask drawn
    # here from the same key (one Bernoulli per slot).
    e = int(mask.sum())
    keep = np.asarray(jax.random.bernoulli(jax.random.PRNGKey(9), 0.7, (edges.capacity,)))
    assert 0.4 < keep[:e].mean() < 0.95  # the mask keeps ~70% of the edges
    rr, cc = np.asarray(edges.rows)[:e], np.asarray(edges.cols)[:e]
    full_scale = jnp.zeros((N, M)).at[rr, cc].set(scale[:e])
    kept = jnp.zeros((N, M)).at[rr, cc].set(jnp.asarray(keep[:e], jnp.float32))

    def dense_fn(q, k, v):
        s = jnp.where(mask, q @ k.T / np.sqrt(D) * full_scale, -jnp.inf)
        w = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
        w = jnp.nan_to_num(w)  # rows without an edge output 0
        return (w * kept / 0.7) @ v

    dense_run = jax.jit(
        lambda q, k, v: (
            dense_fn(q, k, v),
            jax.grad(lambda q, k, v: jnp.sum(dense_fn(q, k, v) * g), argnums=(0, 1, 2))(q, k, v),
        )
    )
    out_dense, dref = dense_run(q, k, v)
    np.testing.assert_allclose(out_rows, out_dense, atol=3e-6)
    for name, a, b in zip("qkv", got, dref, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6, err_msg=f"dense d{name}")


def test_layout_covers_every_valid_slot_once():
    mask = _mask(3, 0.25)
    edges = _edges(mask, extra_slots=9)
    blocks = jax.jit(lambda e: row_blocks(e, N, slots_per_row=3, block_rows=4))(edges)
    row, start, length = (np.asarray(a) for a in blocks)
    assert len(row) % 4 == 0 and np.all(np.diff(row) >= 0)
    seen = np.concatenate([np.arange(s, s + n) for s, n in zip(start, length, strict=True)])
    assert sorted(seen.tolist()) == list(range(int(mask.sum())))
    erows = np.asarray(edges.rows)
    for r_, s, n in zip(row, start, length, strict=True):
        assert np.all(erows[s : s + n] == r_)
    # every query owns at least one virtual row, so a block's queries are consecutive
    assert set(range(N)) <= set(row.tolist())


def test_batched_jit_checkpoint_like_the_layer():
    # vmap over (batch, heads) of jit(checkpoint(...)) as the SBM layer runs it.
    masks = [_mask(s, d) for s, d in ((4, 0.2), (5, 0.5), (6, 0.05))]
    cap = max(int(m.sum()) for m in masks) + 3
    lists = [_edges(m, cap - int(m.sum())) for m in masks]
    edges = jax.tree.map(lambda *a: np.stack(a), *lists)

    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q = jax.random.normal(ks[0], (3, N, D))
    k = jax.random.normal(ks[1], (3, M, D))
    v = jax.random.normal(ks[2], (3, M, DV))
    g = jax.random.normal(ks[3], (3, N, DV))

    def run(impl):
        def one(q, k, v, e):
            return edge_attention(q, k, v, e, edge_scale=jnp.ones_like(e.probs), impl=impl)

        f = jax.checkpoint(jax.vmap(one))
        return jax.jit(
            jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, edges) * g), (0, 1, 2))
        )(q, k, v)

    (lr, gr), (ls, gs) = run("rows"), run("segment")
    np.testing.assert_allclose(lr, ls, rtol=1e-5)
    for a, b in zip(gr, gs, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-6)


def _layer_outputs(kernel: str, with_grad: bool):
    from sbm_jax.attention import get_attention

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 8))
    mask = jnp.ones((2, 16), bool).at[1, 12:].set(False)

    def build(kernel):
        return get_attention("sbm")(
            num_heads=2,
            head_dim=4,
            out_dim=8,
            num_clusters=4,
            impl="sparse",
            capacity_buckets=(0.75,),
            max_dense_elements=1,  # one sparse branch only: keeps compilation short
            kernel=kernel,
        )

    rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
    init = jax.jit(lambda x: nn.unbox(build("segment").init(rngs, x, mask, deterministic=False)))
    params = {"params": init(x)["params"]}

    def f(p, x):
        out = build(kernel).apply(p, x, mask, deterministic=False, rngs={"sample": rngs["sample"]})
        return jnp.sum(out**2)

    if with_grad:
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
    return jax.jit(lambda p, x: build(kernel).apply(p, x, mask, rngs={"sample": rngs["sample"]}))(
        params, x
    )


@pytest.mark.slow  # two layer compilations: ~30 s on a loaded 2-core CPU
def test_sbm_layer_with_rows_kernel_matches_segment():
    # The layer's sparse path (sampler, STE, kernel) under vmap + lax.switch + checkpoint.
    np.testing.assert_allclose(
        _layer_outputs("rows", False), _layer_outputs("segment", False), atol=1e-5
    )


@pytest.mark.slow
def test_sbm_layer_gradients_with_rows_kernel_match_segment():
    (lr, gr), (ls, gs) = _layer_outputs("rows", True), _layer_outputs("segment", True)
    np.testing.assert_allclose(lr, ls, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gs), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_default_block_is_an_eighth_of_the_list_within_bounds():
    from sbm_jax.kernels.rows import DEFAULT_BLOCK_SLOTS, MIN_BLOCK_SLOTS

    assert default_block_slots(2**16) == 2**13  # n=1024 at 5%: 65536 slots
    assert default_block_slots(2**20) == DEFAULT_BLOCK_SLOTS == 2**14
    assert default_block_slots(100) == MIN_BLOCK_SLOTS == 2**10
    assert default_block_slots(3 * 2**14) == 6144  # not a power of two: C // 8


def test_bad_arguments_are_named():
    edges = _edges(_mask(0, 0.3), extra_slots=0)
    q, k, v, _, _ = _inputs(0, edges.capacity)
    with pytest.raises(ValueError, match="impl='nope'"):
        edge_attention(q, k, v, edges, impl="nope")
    with pytest.raises(ValueError, match="slots_per_row"):
        rows_edge_attention(q, k, v, edges, slots_per_row=0)
    with pytest.raises(ValueError, match="block_slots"):
        rows_edge_attention(q, k, v, edges, block_slots=0)
    assert "rows" in KERNELS


def test_cost_model_marks_buckets_by_closed_form():
    from sbm_jax.kernels.cost import EDGE_COST, edge_cost, sparse_buckets_worth_it

    n = m = 1000
    caps = (n * m // 64, n * m // 16, n * m // 4, n * m)
    for backend in ("cpu", "gpu"):
        per_slot = EDGE_COST[backend]["rows"]
        got = sparse_buckets_worth_it(caps, n, m, kernel="rows", backend=backend)
        # A bucket runs sparse iff its slots cost less than the dense path's n*m pairs.
        assert got == tuple(c * per_slot < n * m for c in caps)
        assert got[0] and not got[-1]
        assert edge_cost("rows", backend) == per_slot
    # An explicit slot cost (SBMAttention.edge_cost) overrides the calibration.
    got = sparse_buckets_worth_it(caps, n, m, kernel="rows", slot_cost=3.9)
    assert got == (True, True, True, False)
    # Unmeasured costs are unknown, not borrowed (tests/test_triton_kernel.py: what auto does).
    assert edge_cost("rows", "tpu") is None and edge_cost("rows", "some_new_backend") is None
    with pytest.raises(ValueError, match="kernel='nope'"):
        sparse_buckets_worth_it(caps, n, m, kernel="nope", backend="cpu")


def test_layer_auto_path_keeps_the_buckets_the_calibrated_cost_model_keeps():
    # SBMAttention(edge_cost=None) means the calibration: plan_paths (the layer's static
    # path choice) must keep exactly the buckets whose slots cost less than n*m pairs at
    # EDGE_COST[backend][kernel], and an explicit edge_cost replaces that number.
    from sbm_jax.attention.sbm import SBMOptions, bucket_capacities, plan_paths
    from sbm_jax.kernels.cost import EDGE_COST

    n = 1000
    fractions = (1 / 64, 1 / 16, 1 / 4, 1 / 2)
    all_caps = bucket_capacities(fractions, n, n)
    common = dict(batch=1, heads=1, length=n)
    for backend in ("cpu", "gpu"):
        for kernel in ("rows", "segment"):
            per_slot = EDGE_COST[backend][kernel]
            options = SBMOptions(capacity_buckets=fractions, impl="auto", kernel=kernel)
            caps, dense = plan_paths(options, **common, backend=backend)
            assert caps == tuple(c for c in all_caps if c * per_slot < n * n) and dense
    with_cost = SBMOptions(capacity_buckets=fractions, impl="auto", edge_cost=3.0)
    assert plan_paths(with_cost, **common, backend="cpu")[0] == all_caps[:3]


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_rows_kernel_keeps_float32_scores_under_bf16(scale):
    # bf16 inputs (exactly representable), against float32 compute on the same values:
    # the scores, softmax statistics and accumulation must be float32, so the only error
    # left is the final rounding of the output (and gradients) to bf16 (2^-8 relative).
    # With bf16 scores the error was ~1e-2 at unit scale and ~0.35 at 3x.
    mask = _mask(5, 0.6)
    edges = _edges(mask, extra_slots=4)
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    q, k, v = (
        (scale * jax.random.normal(kk, s)).astype(jnp.bfloat16)
        for kk, s in zip(ks[:3], [(N, 32), (M, 32), (M, DV)], strict=True)
    )
    g = jax.random.normal(ks[3], (N, DV))

    @jax.jit  # one program per dtype, not op-by-op compiles
    def run(q, k, v):
        fn = lambda q, k, v: jnp.sum(  # noqa: E731
            rows_edge_attention(q, k, v, edges).astype(jnp.float32) * g
        )
        return rows_edge_attention(q, k, v, edges), jax.grad(fn, argnums=(0, 1, 2))(q, k, v)

    out, grads = run(q, k, v)
    ref_out, ref_grads = run(*(np.asarray(a, np.float32) for a in (q, k, v)))
    assert out.dtype == jnp.bfloat16 and all(gr.dtype == jnp.bfloat16 for gr in grads)
    # Independent float64 check of the float32 run.
    np.testing.assert_allclose(
        ref_out, _naive(q, k, v, edges, np.ones(edges.capacity)), rtol=1e-4, atol=1e-4
    )
    for low, high in zip((out, *grads), (ref_out, *ref_grads), strict=True):
        low, high = np.asarray(low, np.float32), np.asarray(high)
        np.testing.assert_allclose(low, high, rtol=2**-7, atol=2**-7 * np.abs(high).max())


def _naive_lse(q, k, edges: EdgeList, scale) -> np.ndarray:
    # float64: log sum_e exp(scaled score) over each row's valid slots; 0 without edges.
    q, k, scale = (np.asarray(a, np.float64) for a in (q, k, scale))
    rows, cols, ok = (np.asarray(a) for a in (edges.rows, edges.cols, edges.valid))
    lse = np.zeros(q.shape[0])
    for i in range(q.shape[0]):
        sel = np.nonzero(ok & (rows == i))[0]
        if len(sel):
            s = np.array([q[i] @ k[cols[e]] / np.sqrt(q.shape[1]) * scale[e] for e in sel])
            lse[i] = s.max() + np.log(np.exp(s - s.max()).sum())
    return lse


# Backend-bound kernels (the GPU's "triton") are checked in interpret mode in their own file.
@pytest.mark.parametrize("impl", ["segment", *(k for k in KERNELS if k not in KERNEL_BACKENDS)])
def test_return_lse_is_each_rows_log_normaliser_without_gradient(impl):
    mask = _mask(2, 0.3)
    edges = _edges(mask, extra_slots=6)
    q, k, v, scale, g = _inputs(2, edges.capacity)
    attend = partial(edge_attention, k=k, v=v, edges=edges, edge_scale=scale, impl=impl)
    out, lse = jax.jit(partial(attend, return_lse=True))(q)
    np.testing.assert_allclose(lse, _naive_lse(q, k, edges, scale), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(lse)[~mask.any(1)] == 0.0)
    np.testing.assert_allclose(out, jax.jit(attend)(q))

    # lse carries no gradient: a loss on it and the output has the output's gradient.
    def loss(q, with_lse):
        o, s = edge_attention(q, k, v, edges, edge_scale=scale, impl=impl, return_lse=True)
        return jnp.sum(o * g) + (jnp.sum(s**2) if with_lse else 0.0)

    both = jax.jit(lambda q: (jax.grad(loss)(q, True), jax.grad(loss)(q, False)))
    np.testing.assert_array_equal(*both(q))
