"""The fused CPU kernel (sbm_jax/kernels/fused.py, fused_cpu.cc): law, numbers, threads.

References are independent of the kernel: the law against its closed form (chi-square
over pairs, many seeds), outputs and gradients against float64 numpy on the kernel's own
graphs (``fused_graph_masks`` runs the kernel's row routine alone), with the gradients
written out by hand for eq. 9, the released code's clipped estimator and the ``"pairs"``
estimator (every absent pair added to its row by hand; exact when the probes cover every
key), and the layer against the dense reference on the graphs it drew.
"""

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.kernels import fused
from sbm_jax.kernels.fused import FusedConfig, fused_graph_masks, fused_sbm_attention
from tests.test_dense_path import K_MASK, Q_MASK, M, N, _inputs, _numpy_reference

pytestmark = pytest.mark.skipif(
    not fused.fused_status()[0], reason=f"fused kernel unavailable: {fused.fused_status()[1]}"
)


def _f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def _plan(ys, zk, delta, law, q_mask=Q_MASK, k_mask=K_MASK):
    """Oversampling and row rates of one graph, in numpy (the layer's formulas)."""
    p = np.asarray(ys, np.float64) @ np.asarray(zk, np.float64).T
    real = q_mask[:, None] & k_mask[None, :]
    if law == "bernoulli":
        bound = np.max(np.where(real, p, 0.0), axis=1) + delta
        bound = np.where(q_mask, bound, 0.0)
        c = np.where(
            bound > 1e-6, -np.log1p(-np.clip(bound, 1e-6, 1 - 1e-7)) / np.clip(bound, 1e-6, 1), 1.0
        )
    else:
        c = np.ones(p.shape[0])
    rate = c * np.sum(np.where(real, p + delta, 0.0), axis=1)
    return c.astype(np.float32), rate.astype(np.float32)


def _seeds(key, shape=()):
    return jax.random.bits(key, (*shape, 2), jnp.uint32)


# ----------------------------------------------------------------------------- the law
#: The kernel's rule (fused_cpu.cc, dense_row): a row is drawn pair by pair when its
#: expected draws exceed this share of the real keys or its oversampling exceeds 5.3.
DENSE_SHARE, DENSE_OVERSAMPLE = 0.25, 5.3


@pytest.mark.parametrize("law", ["bernoulli", "poisson"])
@pytest.mark.parametrize("delta", [0.0, 0.05])
@pytest.mark.parametrize("scale", [0.1, 1.5])
def test_graphs_have_the_law_and_never_touch_padding(law, delta, scale):
    # scale 0.1: every row drawn by fastRG (draws, collapse, thinning); 1.5: p up to ~0.8,
    # p + delta above 1 on some pairs (a bound above 0.995), most rows drawn pair by pair.
    trials = 6000
    _, _, _, _, ys, zk = _inputs(1, zero_rows=())
    ys = ys * scale
    p = ys @ zk.T
    rate = p + delta
    want = np.minimum(rate, 1.0) if law == "bernoulli" else 1.0 - np.exp(-rate)
    real = Q_MASK[:, None] & K_MASK[None, :]
    want = np.where(real, want, 0.0)
    c, row_rate = _plan(ys, zk, delta, law)
    dense = (row_rate > DENSE_SHARE * K_MASK.sum()) | (c > DENSE_OVERSAMPLE)
    assert not dense.any() if scale < 1 else dense[Q_MASK].mean() > 0.5, "the case's rows"
    ys32, zk32 = _f32(ys, zk)
    qm, km = jnp.asarray(Q_MASK), jnp.asarray(K_MASK)

    @jax.jit
    def draw(key):
        k1, k2 = jax.random.split(key)
        counts = jax.random.poisson(k1, jnp.asarray(row_rate)).astype(jnp.int32)
        return fused_graph_masks(
            _seeds(k2), ys32, zk32, jnp.asarray(c), counts, qm, km, jnp.float32(delta),
            law=law, forced_half=-1,
        ).astype(jnp.float32)  # fmt: skip

    keys = jax.random.split(jax.random.PRNGKey(0), trials)
    freq = np.asarray(jax.lax.map(draw, keys, batch_size=500).sum(0)) / trials
    assert freq[~real].sum() == 0.0, "an edge touched a padded token"
    live = real & (want > 0) & (want < 1)
    z = (freq - want)[live] / np.sqrt(want * (1 - want) / trials)[live]
    chi2, dof = float(np.sum(z**2)), int(live.sum())
    # chi-square with `dof` degrees of freedom: mean dof, sd sqrt(2 dof); 5 sd is far out
    assert abs(chi2 - dof) < 5 * np.sqrt(2 * dof), (chi2, dof)
    np.testing.assert_array_equal(freq[real & (want == 0)], 0.0)


def test_forced_edges_are_always_present_and_nothing_else_changes():
    _, _, _, _, ys, zk = _inputs(2, zero_rows=())
    c, row_rate = _plan(ys, zk, 0.0, "bernoulli")
    counts = jax.random.poisson(jax.random.PRNGKey(1), jnp.asarray(row_rate)).astype(jnp.int32)
    args = (_seeds(jax.random.PRNGKey(2)), *_f32(ys, zk), jnp.asarray(c), counts)
    masks = (jnp.asarray(Q_MASK), jnp.asarray(K_MASK), jnp.float32(0.0))
    plain = np.asarray(fused_graph_masks(*args, *masks, law="bernoulli", forced_half=-1))
    half = 2
    forced = np.asarray(fused_graph_masks(*args, *masks, law="bernoulli", forced_half=half))
    band = np.abs(np.arange(N)[:, None] - np.arange(M)[None, :]) <= half
    band &= Q_MASK[:, None] & K_MASK[None, :]
    # The band is present; off the band the graph is the same draw (forced pairs are not
    # thinned, and the other pairs' uniforms are keyed by (row, col)).
    assert forced[band].all()
    np.testing.assert_array_equal(forced[~band], plain[~band])


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "ste, half, rate, threads, cache",
    [
        ("paper", -1, 0.0, 1, 0),
        ("paper", 1, 0.3, 2, N * M),
        ("reference", -1, 0.0, 2, 0),
        ("reference", 2, 0.2, 1, N * M),
        ("pairs", -1, 0.0, 2, 0),
        ("pairs", 1, 0.0, 1, N * M),
    ],
)
def test_outputs_and_gradients_match_numpy_on_the_kernels_graph(ste, half, rate, threads, cache):
    """``cache``: edge slots the forward pass keeps for the backward (N * M: every edge)."""
    q, k, v, g, ys, zk = _inputs(3)
    g = 6.0 * g  # large cotangents: the reference estimator's clip is active
    cnt_ct = 0.4
    delta = 0.0
    c, row_rate = _plan(ys, zk, delta, "bernoulli")
    counts = jax.random.poisson(jax.random.PRNGKey(4), jnp.asarray(row_rate)).astype(jnp.int32)
    seeds, dseeds = _seeds(jax.random.PRNGKey(5)), _seeds(jax.random.PRNGKey(6))
    qm, km = jnp.asarray(Q_MASK), jnp.asarray(K_MASK)
    cfg = FusedConfig("bernoulli", half, rate, ste, probes=M, threads=threads, cache_slots=cache)

    def loss(q, k, v, ys, zk):
        out, count, edges = fused_sbm_attention(
            cfg, seeds, dseeds, q, k, v, ys, zk, jnp.asarray(c), counts, qm, km,
            jnp.float32(delta),
        )  # fmt: skip
        if ste == "pairs":  # the layer adds the count's closed form (every real pair)
            from sbm_jax.kernels.pairs import expected_pair_sum

            e = expected_pair_sum(ys, zk, qm, km)
            count = count + e - jax.lax.stop_gradient(e)
        return jnp.sum(out * jnp.asarray(g, jnp.float32)) + cnt_ct * count, (out, edges)

    args = _f32(q, k, v, ys, zk)
    (val, (out, edges)), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(
        *args
    )
    mask = np.asarray(
        fused_graph_masks(seeds, *_f32(ys, zk), jnp.asarray(c), counts, qm, km, jnp.float32(delta),
                          law="bernoulli", forced_half=half)
    )  # fmt: skip
    keep = None
    if rate:
        keep = np.asarray(_dropout_keep(dseeds, rate))
    ref_out, ref_loss, ref_grads = _numpy_reference(
        q, k, v, g, ys, zk, mask, cnt_ct, ste, keep, rate
    )
    assert int(edges) == mask.sum()
    empty = ~mask.any(1)
    assert empty[[3, 11]].all() if half < 0 else empty[~Q_MASK].all()
    assert np.all(np.asarray(out)[empty] == 0.0), "rows without an edge output exactly 0"
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val, ref_loss, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "ys", "zk"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=3e-5, err_msg=name)


def _philox(key, counter):
    """Philox4x32-10 in numpy (Salmon et al. 2011), written out independently of the kernel."""
    m0, m1, w0, w1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
    k0, k1 = (int(x) for x in key)
    c = [int(x) for x in counter]
    for r in range(10):
        if r:
            k0, k1 = (k0 + w0) & 0xFFFFFFFF, (k1 + w1) & 0xFFFFFFFF
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & 0xFFFFFFFF, p1 & 0xFFFFFFFF,
             ((p0 >> 32) ^ c[3] ^ k1) & 0xFFFFFFFF, p0 & 0xFFFFFFFF]  # fmt: skip
    return c


def _dropout_keep(dseeds, rate):
    """The documented dropout draw: pair (i, j) is kept when the top 24 bits of the first
    Philox word of counter (i, j, 3, 0) under the dropout seed, as a float in [0, 1), are
    below 1 - rate."""
    key = np.asarray(dseeds)
    keep = np.zeros((N, M), bool)
    for i in range(N):
        for j in range(M):
            word = _philox(key, (i, j, 3, 0))[0]
            keep[i, j] = np.float32(word >> 8) * np.float32(2.0**-24) < np.float32(1.0 - rate)
    return keep


def test_threads_and_graph_batches_give_the_same_numbers():
    # 3 graphs: with 2 threads one round runs two graphs at once and the third is split by
    # rows (private key-side accumulators); with 1 thread everything runs in order. Same
    # graphs, same outputs, same gradients (up to the order of float sums).
    rng = np.random.default_rng(9)
    G = 3
    q = jnp.asarray(rng.normal(size=(G, N, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(G, M, 4)), jnp.float32) for _ in range(2))
    ys = jnp.asarray(rng.random((G, N, 3)) * 0.3, jnp.float32) * Q_MASK[:, None]
    zk = jnp.asarray(rng.random((G, M, 3)), jnp.float32) * K_MASK[:, None]
    c = jnp.ones((G, N), jnp.float32)
    counts = jnp.asarray(rng.poisson(3.0, size=(G, N)) * Q_MASK, jnp.int32)
    seeds = _seeds(jax.random.PRNGKey(1), (G,))
    masks = (
        jnp.broadcast_to(jnp.asarray(Q_MASK), (G, N)),
        jnp.broadcast_to(jnp.asarray(K_MASK), (G, M)),
    )
    g = jnp.asarray(rng.normal(size=(G, N, 4)), jnp.float32)

    def run(threads):
        cfg = FusedConfig("poisson", 1, 0.0, "paper", probes=4, threads=threads)

        def loss(q, k, v, ys, zk):
            out, count, _ = fused_sbm_attention(
                cfg, seeds, seeds, q, k, v, ys, zk, c, counts, *masks, jnp.zeros((G,))
            )
            return jnp.sum(out * g) + 0.3 * jnp.sum(count)

        return jax.jit(jax.value_and_grad(loss, argnums=range(5)))(q, k, v, ys, zk)

    (v1, g1), (v2, g2), (v3, g3) = run(1), run(2), run(3)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    np.testing.assert_allclose(v1, v3, rtol=1e-6)
    for a, b, cc in zip(g1, g2, g3, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, cc, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_edge_cache_holds_the_blocks_that_fit_and_changes_no_number(threads):
    """Three graphs of 600 query rows (three row blocks each: 256, 256, 88) and a cache
    with room for the first block only: the forward pass keeps
    exactly the kernel's graph for the blocks that fit (against ``fused_graph_masks``),
    and outputs and gradients are those without a cache, or with room for every edge (bit
    for bit where the order of the sums is fixed). With 2 threads the third graph's
    blocks are shared out to the threads."""
    rng = np.random.default_rng(3)
    G, n, m, kc, d = 3, 600, 40, 3, 4
    q = jnp.asarray(rng.normal(size=(G, n, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(G, m, d)), jnp.float32) for _ in range(2))
    ys = jnp.asarray(rng.random((G, n, kc)) * 0.02, jnp.float32)  # no row drawn pair by pair
    zk = jnp.asarray(rng.random((G, m, kc)), jnp.float32)
    c = jnp.ones((G, n), jnp.float32)
    counts = jnp.asarray(rng.poisson(4.0, size=(G, n)), jnp.int32)
    seeds = _seeds(jax.random.PRNGKey(7), (G,))
    qm, km = jnp.ones((G, n), bool), jnp.ones((G, m), bool)
    delta = jnp.zeros((G,))
    g = jnp.asarray(rng.normal(size=(G, n, d)), jnp.float32)
    # A row's edge bound is its draws plus its forced pairs (3), at most m.
    bounds = np.minimum(np.asarray(counts) + 3, m)
    first_block = int(bounds[:, :256].sum(1).max())
    cfgs = {
        slots: FusedConfig("poisson", 1, 0.0, "paper", probes=4, threads=threads, cache_slots=slots)
        for slots in (0, first_block, n * m)
    }

    def run(cfg):
        def loss(q, k, v, ys, zk):
            out, count, _ = fused_sbm_attention(
                cfg, seeds, seeds, q, k, v, ys, zk, c, counts, qm, km, delta
            )
            return jnp.sum(out * g) + 0.3 * jnp.sum(count)

        return jax.jit(jax.value_and_grad(loss, argnums=range(5)))(q, k, v, ys, zk)

    # What the forward pass keeps, against the kernel's graphs.
    mask = np.asarray(
        fused_graph_masks(seeds, ys, zk, c, counts, qm, km, delta, law="poisson", forced_half=1)
    )
    ops = fused._operands(q, k, v, ys, zk, c, counts, qm, km, delta, seeds, seeds)
    _, _, _, cols, kept = jax.jit(partial(fused._forward, cfgs[first_block]))(ops)
    cols, kept = np.asarray(cols), np.asarray(kept)  # kept [G, n, 2]: (start, count)
    for gi in range(G):
        rows = mask[gi, :256]
        np.testing.assert_array_equal(kept[gi, :256, 1], rows.sum(1))
        for i in range(256):
            start, count = kept[gi, i]
            np.testing.assert_array_equal(cols[gi, start : start + count], np.nonzero(rows[i])[0])
        assert np.all(kept[gi, 256:, 1] == -1)  # not kept: drawn again in the backward pass
    assert first_block < int(bounds[:, :512].sum(1).min())  # the second block did not fit
    (v0, g0), (v1, g1), (v2, g2) = (run(cfgs[s]) for s in sorted(cfgs))
    assert v0 == v1 == v2
    for a, b, cc in zip(g0, g1, g2, strict=True):
        # Bit for bit, but for the shared graph's key-side sums, whose order follows which
        # thread took which block.
        exact = slice(0, 2) if threads > 1 else slice(None)
        np.testing.assert_array_equal(a[exact], b[exact])
        np.testing.assert_array_equal(a[exact], cc[exact])
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, cc, rtol=1e-6, atol=1e-6)


def test_vmap_adds_graph_axes_and_bfloat16_keeps_float32_statistics():
    q, k, v, g, ys, zk = _inputs(4)
    c, row_rate = _plan(ys, zk, 0.02, "bernoulli")
    counts = jax.random.poisson(jax.random.PRNGKey(2), jnp.asarray(row_rate), (3, N)).astype(
        jnp.int32
    )
    seeds = _seeds(jax.random.PRNGKey(3), (3,))
    cfg = FusedConfig("bernoulli", -1, 0.0, "paper", probes=4, threads=2)
    qm, km = jnp.asarray(Q_MASK), jnp.asarray(K_MASK)

    def one(seed, count, q):
        return fused_sbm_attention(
            cfg,
            seed,
            seed,
            q,
            *_f32(k, v, ys, zk),
            jnp.asarray(c),
            count,
            qm,
            km,
            jnp.float32(0.02),
        )[0]

    q3 = jnp.asarray(np.stack([q, 2 * q, -q]), jnp.float32)
    mapped = jax.jit(jax.vmap(one))(seeds, counts, q3)
    for t in range(3):
        np.testing.assert_allclose(mapped[t], one(seeds[t], counts[t], q3[t]), rtol=1e-6, atol=1e-6)
    half = jax.jit(one)(seeds[0], counts[0], q3[0].astype(jnp.bfloat16))
    assert half.dtype == jnp.float32  # the dtype of v
    np.testing.assert_allclose(half, mapped[0], rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- the plan
def test_fused_draws_row_rates_leave_padded_keys_out_and_bound_every_real_pair():
    """The plan against numpy, with padded keys given the largest memberships: each row's
    mean draws over 400 keys against c_i sum_j (p_ij + delta) over the real keys only;
    the oversampling c_i at least the closed form -log(1 - q) / q of the row's true
    maximum q (c grows with the bound); the graph bound above every real pair."""
    from sbm_jax.attention.sbm import fused_draws

    rng = np.random.default_rng(0)
    b, h, n, kc, delta, reps = 2, 2, 24, 5, 0.01, 400
    mask = np.ones((b, n), bool)
    mask[1, 17:] = False
    ys = rng.uniform(0, 0.05, (b, h, n, kc)).astype(np.float32)
    zk = rng.uniform(0, 1, (b, h, n, kc)).astype(np.float32)
    zk[1, :, 17:] = 3.0  # padded keys outweigh every real one

    def plan(key):
        return fused_draws(
            key, jnp.asarray(ys), jnp.asarray(zk), jnp.asarray(mask), jnp.float32(delta),
            "bernoulli",
        )  # fmt: skip

    c, counts, bound = jax.jit(jax.vmap(plan))(jax.random.split(jax.random.PRNGKey(1), reps))
    c, bound = np.asarray(c[0], np.float64), np.asarray(bound[0], np.float64)
    p = np.einsum("bhik,bhjk->bhij", ys.astype(np.float64), zk.astype(np.float64))
    real_pair = mask[:, None, :, None] & mask[:, None, None, :]
    rate = c * np.where(real_pair, p + delta, 0.0).sum(-1)  # [b, h, n], 0 on padded rows
    mean = np.asarray(counts, np.float64).mean(0)
    np.testing.assert_array_less(np.abs(mean - rate), 6 * np.sqrt(rate / reps) + 1e-9)
    row_max = np.where(real_pair, p + delta, 0.0).max(-1)
    real_row = np.broadcast_to(mask[:, None], c.shape)
    q = np.clip(row_max[real_row], 1e-6, 1 - 1e-7)
    assert np.all(c[real_row] >= -np.log1p(-q) / q * (1 - 1e-5))
    assert np.all(bound >= row_max.max(-1) * (1 - 1e-6))


# ----------------------------------------------------------------------------- the layer
def test_layer_with_the_fused_kernel_matches_the_dense_reference_on_its_graphs():
    from sbm_jax.attention.sbm import fused_draws, sbm_attention_core
    from tests.sbm_testing import dense_loss_on_masks
    from tests.test_sbm_attention import MASK, _core_case

    q, k, v, qm, blk, km, g, wd = _core_case()
    rng, delta = jax.random.PRNGKey(3), 0.05
    opts = dict(delta=delta, law="bernoulli", kernel="fused", impl="sparse", window=2)

    def core_loss(q, k, v, qm, blk, km):
        out, st = sbm_attention_core(rng, q, k, v, qm, blk, km, MASK, **opts)
        return jnp.sum(out * g) + jnp.sum(st["density"] * wd), (st, out)

    args = (q, k, v, qm, blk, km)
    (val, (st, out)), grads = jax.jit(
        jax.value_and_grad(core_loss, argnums=range(6), has_aux=True)
    )(*args)
    # The layer's graphs, drawn again the way the fused core documents it.
    real = MASK.astype(jnp.float32)[:, None, :, None]
    ys = jnp.einsum("bhik,hkl->bhil", qm * real, blk)
    zk = km * real
    k_count, k_sample = jax.random.split(rng)
    # The core passes the key memberships unmasked (the plan masks what it sums).
    c, counts, _ = fused_draws(k_count, ys, km, MASK, jnp.float32(delta), "bernoulli")
    keys = jax.random.split(k_sample, q.shape[:2])
    seeds = jax.vmap(jax.vmap(lambda kk: jax.random.bits(kk, (2,), jnp.uint32)))(keys)
    masks_b = jnp.broadcast_to(MASK[:, None, :], counts.shape)
    masks = np.asarray(
        fused_graph_masks(seeds, ys, zk, c, counts, masks_b, masks_b,
                          jnp.full(q.shape[:2], delta), law="bernoulli", forced_half=1)
    )  # fmt: skip
    assert int(st["path"]) == 0
    np.testing.assert_array_equal(st["edges"], masks.sum((2, 3)))
    ref_loss = dense_loss_on_masks(masks, g, wd, mask=MASK, ste="paper")
    ref_val, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=range(6)))(*args)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for name, a, b in zip(
        ("q", "k", "v", "q_memb", "block", "k_memb"), grads, ref_grads, strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "ste, rate, window, cache",
    [("paper", 0.0, 2, 0), ("reference", 0.2, 0, 16), ("pairs", 0.0, 1, 0)],
)
def test_the_per_batch_choice_gives_the_chosen_paths_numbers(ste, rate, window, cache):
    """``impl="auto"`` runs the fused kernel or the XLA dense path per batch under one
    custom VJP (``fused_or_dense_attention``): whichever the cost model picks, the output,
    the stats and every gradient are those of that path compiled alone (``impl="sparse"``,
    the kernel; ``impl="dense"``, the dense path), with dropout, the edge cache and each
    estimator (``"pairs"`` adds the kernel's closed-form count term only when the kernel
    runs)."""
    from sbm_jax.attention.sbm import sbm_attention_core
    from tests.test_sbm_attention import MASK, _core_case

    q, k, v, qm, blk, km, g, wd = _core_case(1)
    rng, drop = jax.random.PRNGKey(5), jax.random.PRNGKey(6)
    base = dict(
        delta=0.05, law="bernoulli", kernel="fused", ste=ste, window=window,
        edge_cache=cache, dropout_rate=rate, dense_below=0,
    )  # fmt: skip

    def run(**opts):
        def loss(*args):
            out, st = sbm_attention_core(
                rng, *args, MASK, dropout_rng=drop if rate else None, **base, **opts
            )
            return jnp.sum(out * g) + jnp.sum(st["density"] * wd), (st, out)

        grad = jax.value_and_grad(loss, argnums=range(6), has_aux=True)
        (val, (st, out)), grads = jax.jit(grad)(q, k, v, qm, blk, km)
        return val, st, out, grads

    for impl_alone, cost, path in (("sparse", 1e-6, 0), ("dense", 1e6, None)):
        got = run(impl="auto", edge_cost=cost)
        want = run(impl=impl_alone)
        if path is not None:
            assert int(got[1]["path"]) == path
        else:  # the dense path's recorded index, after the capacity buckets
            assert int(got[1]["path"]) == int(want[1]["path"]) > 0
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_array_equal(got[1]["edges"], want[1]["edges"])
        np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-7)
        names = ("q", "k", "v", "q_memb", "block", "k_memb")
        for name, a, b in zip(names, got[3], want[3], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{impl_alone} {name}")


# ----------------------------------------------------------------------------- bad input
def test_the_layer_keeps_the_plan_and_edge_cache_so_its_backward_redraws_neither():
    """The layer's fwd+bwd program holds one fused forward call and the plan's Poisson
    draws once (the checkpoint policy keeps the kernel's outputs, the plan and the edge
    cache), and ``edge_cache`` changes no gradient."""
    from sbm_jax.attention import get_attention

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 96, 8))
    mask = jnp.arange(96)[None, :] < jnp.asarray([[96], [70]])

    def build(**opts):
        mod = get_attention("sbm")(
            num_heads=2, head_dim=4, out_dim=8, kernel="fused", impl="sparse", **opts
        )
        rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
        params = mod.init(rngs, x, mask, deterministic=False)["params"]

        def loss(p, x):
            out = mod.apply(
                {"params": p}, x, mask, deterministic=False, rngs={"sample": jax.random.PRNGKey(3)}
            )
            return jnp.sum(out**2)

        return loss, params

    grads = {}
    for cache in (0, 24):
        loss, params = build(edge_cache=cache)
        forward = str(jax.make_jaxpr(loss)(params, x))
        both = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))
        assert both.count("sbm_fused_forward") == forward.count("sbm_fused_forward") == 1
        assert both.count("sbm_fused_backward") == 1
        assert both.count("poisson") == forward.count("poisson") > 0
        grads[cache] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for a, b in zip(*(jax.tree_util.tree_leaves(g) for g in grads.values()), strict=True):
        np.testing.assert_array_equal(a, b)


def test_operand_shapes_are_checked_before_the_kernel_runs():
    q = jnp.ones((2, N, 4))
    cfg = FusedConfig("poisson", -1, 0.0, "paper", probes=4, threads=1)
    ops = dict(
        k=jnp.ones((2, M, 4)), v=jnp.ones((2, M, 4)), ys=jnp.ones((2, N, 3)), z=jnp.ones((2, N, 3)),
        oversample=jnp.ones((2, N)), counts=jnp.zeros((2, N), jnp.int32),
        q_mask=jnp.ones((2, N), bool), k_mask=jnp.ones((2, M), bool), delta=jnp.zeros((2,)),
    )  # fmt: skip
    seeds = jnp.zeros((2, 2), jnp.uint32)
    with pytest.raises(ValueError, match=r"z has shape \(2, 21, 3\), expected \(2, 19, 3\)"):
        fused_sbm_attention(cfg, seeds, seeds, q, *ops.values())


def test_an_edge_cache_past_int32_offsets_is_refused_naming_the_field():
    q, k, v, g, ys, zk = _inputs(1)
    c, _ = _plan(ys, zk, 0.0, "poisson")
    cfg = FusedConfig("poisson", -1, 0.0, "paper", probes=4, threads=1, cache_slots=2**31)
    with pytest.raises(ValueError, match="edge_cache: 2147483648 edge slots per graph"):
        seeds = _seeds(jax.random.PRNGKey(0))
        fused_sbm_attention(
            cfg, seeds, seeds, *_f32(q, k, v, ys, zk), jnp.asarray(c),
            jnp.ones((N,), jnp.int32), jnp.asarray(Q_MASK), jnp.asarray(K_MASK), jnp.float32(0.0),
        )  # fmt: skip


def test_the_fused_kernel_is_refused_off_the_cpu_in_one_line():
    from sbm_jax.kernels.cost import resolve_kernel

    for backend in ("gpu", "tpu"):
        with pytest.raises(ValueError, match=f"kernel='fused'.*backend '{backend}'"):
            resolve_kernel("fused", backend)
    assert resolve_kernel("auto", "cpu") == "fused"
    assert resolve_kernel("auto", "gpu") == "rows"


def test_without_a_compiler_auto_falls_back_with_one_warning(monkeypatch):
    from sbm_jax.kernels import cost

    monkeypatch.setattr(fused, "fused_status", lambda: (False, "no C++ compiler on PATH"))
    monkeypatch.setattr(cost, "_warned", set())
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert cost.resolve_kernel("auto", "cpu") == "rows"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost.resolve_kernel("auto", "cpu") == "rows"  # said once
    with pytest.raises(ValueError, match="kernel='fused' is unavailable here: no C\\+\\+ compiler"):
        cost.resolve_kernel("fused", "cpu")


def test_a_failed_build_names_the_compiler_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SBM_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(fused, "_compiler", lambda: "false")
    with pytest.raises(fused.FusedUnavailable, match="building the fused CPU kernel failed"):
        fused._build(tmp_path / "x.so")
    assert not list(tmp_path.glob("*.so")), "no half-written library is left behind"


@pytest.mark.slow
def test_the_portable_build_without_vector_extensions_gives_the_same_numbers(tmp_path):
    # The library built for a plain x86-64 (no AVX2, no AVX-512: the scalar Philox,
    # searches and loops) passes the law and numbers tests above, in a fresh process.
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the portable build is checked on x86-64")
    env = dict(os.environ, SBM_JAX_FUSED_ARCH="x86-64", SBM_JAX_CACHE=str(tmp_path))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    cmd += ["-k", "law or numbers or threads or vmap"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(tmp_path.glob("fused_cpu-*.so")), "the portable library was built there"
