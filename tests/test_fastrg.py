"""fastRG sampler: exact edge laws, layout contract, masks, probabilities, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax import EdgeList, fastrg, sample_sbm_graph
from sbm_jax.fastrg import (
    BERNOULLI_MAX_BOUND,
    GUIDE_SPAN,
    ROW_GUIDE_SPAN,
    ROW_SEARCH_WINDOW,
    SEARCH_WINDOW,
    make_plan,
    sample_dense_mask,
)

N, M, K = 24, 18, 4
Q_MASK = np.arange(N) < 21
K_MASK = np.arange(M) < 16
DELTA = 0.05
TRIALS = 3000

# One program per call, not op-by-op compiles of every operation run eagerly.
_make_plan = jax.jit(make_plan, static_argnames="law")


def _sbm(scale: float, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.uniform(ks[0], (N, K))
    k = jax.random.uniform(ks[1], (M, K))
    s = jax.nn.softmax(jax.random.normal(ks[2], (K * K,))).reshape(K, K) * scale
    return q, s, k


def _dense_p(q, s, k):
    # Independent reference: p = Qhat S Khat^T on real tokens, in float64.
    q, s, k = (np.asarray(a, np.float64) for a in (q, s, k))
    return (q @ s @ k.T) * (Q_MASK[:, None] & K_MASK[None, :])


def _frequencies(edges: EdgeList) -> np.ndarray:
    rows, cols, valid = (np.asarray(a) for a in (edges.rows, edges.cols, edges.valid))
    freq = np.zeros((N, M))
    for t in range(rows.shape[0]):
        np.add.at(freq, (rows[t][valid[t]], cols[t][valid[t]]), 1)
    return freq / rows.shape[0]


def _assert_law(freq: np.ndarray, target: np.ndarray, trials: int) -> None:
    real = Q_MASK[:, None] & K_MASK[None, :]
    assert np.all(freq[~real] == 0), "an edge touched a masked query or key"
    t = target[real]
    var = t * (1 - t) / trials
    z2 = np.where(var > 0, (freq[real] - t) ** 2 / np.maximum(var, 1e-12), 0.0)
    df = int(np.sum(var > 0))
    # Sum of squared z-scores ~ chi2(df): mean df, sd sqrt(2 df). 6 sd is a loose bound
    # that still rejects the wrong law by a wide margin (see test_laws_are_distinguishable).
    assert abs(z2.sum() - df) < 6 * np.sqrt(2 * df), (z2.sum(), df)
    assert np.max(z2) < 36.0  # no single pair more than 6 sd off
    assert np.all(freq[real][t == 1.0] == 1.0)


def _sample_many(law: str, scale: float, capacity: int = N * M, trials: int = TRIALS):
    q, s, k = _sbm(scale)
    keys = jax.random.split(jax.random.PRNGKey(7), trials)
    fn = jax.jit(
        jax.vmap(
            lambda key: sample_sbm_graph(
                key,
                q,
                s,
                k,
                capacity=capacity,
                delta=DELTA,
                q_mask=jnp.asarray(Q_MASK),
                k_mask=jnp.asarray(K_MASK),
                law=law,
            )
        )
    )
    return fn(keys), _dense_p(q, s, k)


@pytest.fixture(scope="module")
def bernoulli_sparse():
    return _sample_many("bernoulli", 0.8)


@pytest.fixture(scope="module")
def poisson_sparse():
    return _sample_many("poisson", 0.8)


def test_bernoulli_law_sparse_regime(bernoulli_sparse):
    edges, p = bernoulli_sparse
    plan = _make_plan(*_sbm(0.8), delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="bernoulli")
    assert float(plan.bound) <= BERNOULLI_MAX_BOUND  # this case exercises oversample + thin
    assert float(plan.bound) >= p.max() + DELTA - 1e-6  # and the bound is a bound
    assert not np.asarray(edges.overflow).any()
    _assert_law(_frequencies(edges), np.minimum(1.0, p + DELTA), TRIALS)


def test_poisson_law(poisson_sparse):
    edges, p = poisson_sparse
    assert not np.asarray(edges.overflow).any()
    _assert_law(_frequencies(edges), 1.0 - np.exp(-(p + DELTA)), TRIALS)


def test_laws_are_distinguishable(bernoulli_sparse, poisson_sparse):
    # The statistical check has power: each law's samples fail the other law's target.
    edges_b, p = bernoulli_sparse
    edges_p, _ = poisson_sparse
    with pytest.raises(AssertionError):
        _assert_law(_frequencies(edges_p), np.minimum(1.0, p + DELTA), TRIALS)
    with pytest.raises(AssertionError):
        _assert_law(_frequencies(edges_b), 1.0 - np.exp(-(p + DELTA)), TRIALS)


def test_bernoulli_law_dense_regime():
    # p + delta exceeds 1 for some pairs: the bound is > 1 and the draw goes dense.
    edges, p = _sample_many("bernoulli", 3.0, trials=1500)
    assert p.max() + DELTA > 1.0
    _assert_law(_frequencies(edges), np.minimum(1.0, p + DELTA), 1500)


def test_dense_mask_same_law():
    q, s, k = _sbm(0.8)
    p = jnp.asarray(_dense_p(q, s, k), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), TRIALS)
    for law, target in (
        ("bernoulli", np.minimum(1.0, np.asarray(p) + DELTA)),
        ("poisson", 1.0 - np.exp(-(np.asarray(p) + DELTA))),
    ):
        masks = jax.jit(
            jax.vmap(
                lambda key, law=law: sample_dense_mask(
                    key, p, DELTA, jnp.asarray(Q_MASK), jnp.asarray(K_MASK), law
                )
            )
        )(keys)
        _assert_law(np.asarray(masks).mean(0), target, TRIALS)


def test_layout_contract_and_probs(bernoulli_sparse):
    edges, p = bernoulli_sparse
    rows, cols, valid, probs = (
        np.asarray(a) for a in (edges.rows, edges.cols, edges.valid, edges.probs)
    )
    num_edges = np.asarray(edges.num_edges)
    for t in range(50):
        nv = int(valid[t].sum())
        assert nv == int(num_edges[t])
        assert valid[t][:nv].all() and not valid[t][nv:].any(), "valid edges must come first"
        keys = rows[t][:nv] * M + cols[t][:nv]
        assert np.all(np.diff(keys) > 0), "valid edges sorted by (row, col), no duplicates"
        assert np.all(np.diff(rows[t]) >= 0), "rows non-decreasing over all slots"
        assert np.all(rows[t][nv:] == N - 1)
        np.testing.assert_allclose(probs[t][:nv], p[rows[t][:nv], cols[t][:nv]], rtol=1e-5)
        assert np.all(probs[t][nv:] == 0)


def test_overflow_is_flagged():
    q, s, k = _sbm(0.8)
    sample = jax.jit(functools.partial(sample_sbm_graph, capacity=5, delta=DELTA, law="poisson"))
    edges = sample(jax.random.PRNGKey(0), q, s, k)
    assert int(edges.num_draws) > 5
    assert bool(edges.overflow)
    assert int(edges.num_edges) <= 5


def test_num_draws_is_poisson_mean():
    q, s, k = _sbm(0.8)
    plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="poisson")
    p = _dense_p(q, s, k)
    real = Q_MASK[:, None] & K_MASK[None, :]
    np.testing.assert_allclose(float(plan.expected_edges), (p + DELTA * real).sum(), rtol=1e-4)


def test_zero_memberships_give_no_edges():
    q, s, k = _sbm(0.8)
    sample = jax.jit(functools.partial(sample_sbm_graph, capacity=64, delta=0.0))
    edges = sample(jax.random.PRNGKey(0), jnp.zeros_like(q), s, k)
    assert int(edges.num_edges) == 0 and not bool(edges.overflow)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=0), "capacity"),
        (dict(capacity=10, delta=-0.1), "delta"),
        (dict(capacity=10, law="gumbel"), "law"),
        (dict(capacity=10, q_mask=jnp.ones((N + 1,), bool)), "q_mask"),
    ],
)
def test_bad_input(kwargs, match):
    q, s, k = _sbm(0.8)
    with pytest.raises(ValueError, match=match):
        sample_sbm_graph(jax.random.PRNGKey(0), q, s, k, **kwargs)


def test_mismatched_clusters():
    q, s, k = _sbm(0.8)
    with pytest.raises(ValueError, match="cluster"):
        sample_sbm_graph(jax.random.PRNGKey(0), q, s[:3, :3], k, capacity=10)
    with pytest.raises(ValueError, match="k_memberships"):
        sample_sbm_graph(jax.random.PRNGKey(0), q, s, k[None], capacity=10)


@pytest.mark.parametrize("peaked", [False, True])
def test_bernoulli_rows_are_oversampled_by_their_own_bound(peaked):
    q, s, k = _sbm(0.8)
    if peaked:
        # Query rows in one cluster each: there the per-cluster maximum is the tighter
        # bound, elsewhere Cauchy-Schwarz is (both must be exercised).
        q = q.at[: N // 2].set(jax.nn.one_hot(jnp.arange(N // 2) % K, K))
        s = jnp.eye(K) * 0.2
    plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="bernoulli")
    p = _dense_p(q, s, k)
    real = Q_MASK[:, None] & K_MASK[None, :]
    row_max = np.where(real, p + DELTA, 0).max(1)
    # Independent recomputation of each row's bound and factor from memberships: the
    # smaller of the per-cluster-maximum and the Cauchy-Schwarz bounds.
    kk = np.asarray(k, np.float64) * K_MASK[:, None]
    ys = np.asarray(q, np.float64) @ np.asarray(s, np.float64)
    by_cluster = ys @ kk.max(0)
    by_norm = np.linalg.norm(ys, axis=1) * np.linalg.norm(kk, axis=1).max()
    q_row = (np.minimum(by_cluster, by_norm) + DELTA) * Q_MASK
    assert np.all(q_row >= row_max - 1e-6)
    tighter = (by_cluster < by_norm)[Q_MASK]
    assert tighter.any() == peaked and (~tighter).any()
    c = np.where(q_row > 0, -np.log1p(-q_row) / np.maximum(q_row, 1e-12), 1.0)
    np.testing.assert_allclose(np.asarray(plan.oversample), c, rtol=1e-4)
    want = (c[:, None] * np.where(real, p + DELTA, 0)).sum()
    np.testing.assert_allclose(float(plan.expected_draws), want, rtol=1e-4)


def _probs_case(seed: int, heads: int, n: int = 7, m: int = 6, k: int = 3, cap: int = 15):
    # Row-sorted edge lists with empty slots at the end, as the sampler lays them out.
    rng = np.random.default_rng(seed)
    ys = rng.random((heads, n, k)).astype(np.float32)
    z = rng.random((heads, m, k + 1)).astype(np.float32)  # last column: exploration
    rows = np.full((heads, cap), n - 1, np.int32)
    cols = np.zeros((heads, cap), np.int32)
    valid = np.zeros((heads, cap), bool)
    for h in range(heads):
        keys = np.unique(rng.integers(0, n * m, size=cap - 3 - h))
        rows[h, : keys.size], cols[h, : keys.size] = keys // m, keys % m
        valid[h, : keys.size] = True
        cols[h, keys.size :] = rng.integers(0, m, size=cap - keys.size)  # junk in empty slots
    w = rng.normal(size=(heads, cap)).astype(np.float32)
    return ys, z, rows, cols, valid, w


def test_edge_probs_straight_through_gradient_is_two_spmms():
    # Closed form in float64: G[i, j] = w_e on the valid edges, dys = G Z[:, :k],
    # dz[:, :k] = G^T ys, dz[:, k:] = 0. Batched over heads (vmap): each head must get its
    # own cotangent, not the sum over heads.
    from sbm_jax.fastrg import edge_probs_straight_through

    ys, z, rows, cols, valid, w = _probs_case(0, heads=3)
    k = ys.shape[-1]

    def loss(ys, z):
        s = jax.vmap(edge_probs_straight_through)(ys, z, rows, cols, valid)
        return jnp.sum(s * w), s

    (_, s), (dys, dz) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(ys, z)
    np.testing.assert_array_equal(s, valid.astype(np.float32))  # the estimator is 1 on edges
    for h in range(ys.shape[0]):
        g = np.zeros((ys.shape[1], z.shape[1]))
        np.add.at(g, (rows[h][valid[h]], cols[h][valid[h]]), w[h][valid[h]])
        np.testing.assert_allclose(dys[h], g @ z[h, :, :k].astype(np.float64), rtol=1e-5)
        np.testing.assert_allclose(dz[h, :, :k], g.T @ ys[h].astype(np.float64), rtol=1e-5)
        assert np.all(np.asarray(dz[h, :, k:]) == 0.0)


def test_edge_probs_straight_through_matches_autodiff_of_edge_probs():
    # Same gradients as straight_through(where(valid, edge_probs(...), 0)) by autodiff,
    # also when the slots span several streamed chunks.
    import sbm_jax.fastrg as fr
    import sbm_jax.ste as ste  # the module whose STE_CHUNK the estimator reads

    ys, z, rows, cols, valid, w = _probs_case(1, heads=1, n=40, m=33, cap=300)
    ys, z, rows, cols, valid, w = (a[0] for a in (ys, z, rows, cols, valid, w))
    k = ys.shape[1]

    def autodiff(ys, z):
        p = jnp.sum(ys[rows] * z[cols, :k], axis=-1)
        return jnp.sum(jnp.where(valid, p, 0.0) * w)

    def fast(ys, z):
        return jnp.sum(fr.edge_probs_straight_through(ys, z, rows, cols, valid) * w)

    want = jax.jit(jax.grad(autodiff, argnums=(0, 1)))(ys, z)
    old = ste.STE_CHUNK
    try:
        ste.STE_CHUNK = 64  # 5 chunks, the last one padded (read when jit traces, here)
        got = jax.jit(jax.grad(fast, argnums=(0, 1)))(ys, z)
    finally:
        ste.STE_CHUNK = old
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sample_edge_keys_are_the_sampler_layout():
    from sbm_jax.fastrg import edges_from_keys, sample_edge_keys, sample_from_plan

    q, s, k = _sbm(0.8)
    plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="bernoulli")
    key, count = jax.random.PRNGKey(4), jnp.asarray(60, jnp.int32)
    static = dict(capacity=80, law="bernoulli")
    keys = jax.jit(functools.partial(sample_edge_keys, **static))(key, plan, count)
    edges = jax.jit(functools.partial(sample_from_plan, **static))(key, plan, count)
    kk = np.asarray(keys)
    nv = int(edges.num_edges)
    assert np.all(np.diff(kk[:nv]) > 0) and np.all(kk[nv:] == N * M)
    light = jax.jit(edges_from_keys, static_argnums=(1, 2))(keys, N, M)
    for name in ("rows", "cols", "valid", "num_edges"):
        np.testing.assert_array_equal(getattr(light, name), getattr(edges, name), err_msg=name)
    # Independent reference: the keys decoded here (row * M + col), and p_e from the
    # float64 dense p, not from the code's edges_from_keys / edge_probs.
    valid = kk != N * M
    np.testing.assert_array_equal(np.asarray(edges.valid), valid)
    assert int(edges.num_edges) == int(valid.sum()) > 20
    rows, cols = kk[valid] // M, kk[valid] % M
    np.testing.assert_array_equal(np.asarray(edges.rows)[valid], rows)
    np.testing.assert_array_equal(np.asarray(edges.cols)[valid], cols)
    assert Q_MASK[rows].all() and K_MASK[cols].all()
    np.testing.assert_allclose(
        np.asarray(edges.probs)[valid], _dense_p(q, s, k)[rows, cols], rtol=1e-5, atol=1e-7
    )


def test_plan_without_tables_samples_the_same_keys_as_the_full_plan():
    # make_plan(tables=False) leaves out the four search tables (the layer builds them per
    # graph, inside its head loop): the rates are those of the full plan, with_tables
    # builds the full plan's tables bit for bit, and the sampler, given the light plan,
    # draws the full plan's keys.
    from sbm_jax.fastrg import sample_edge_keys, with_tables

    q, s, k = _sbm(0.8)
    tables = ("zcdf", "zguide", "row_cdf", "row_guide")
    light_plan = jax.jit(make_plan, static_argnames=("law", "tables"))
    for law in ("bernoulli", "poisson"):
        full = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law=law)
        light = light_plan(
            q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law=law, tables=False
        )
        assert all(getattr(light, t) is None for t in tables)
        for name in ("row_rate", "expected_draws", "oversample", "bound", "ys", "z"):
            np.testing.assert_array_equal(getattr(light, name), getattr(full, name), err_msg=name)
        # The row CDFs end at the rates' totals (up to the order of the sums).
        np.testing.assert_allclose(
            np.asarray(full.row_cdf)[:, -1] * np.asarray(full.oversample),
            full.row_rate,
            rtol=1e-6,
        )
        built = jax.jit(with_tables)(light)
        for t in tables:
            np.testing.assert_array_equal(getattr(built, t), getattr(full, t), err_msg=t)
        _assert_tables_are_the_weights(built, q, s, k)
        draw = jax.jit(functools.partial(sample_edge_keys, capacity=200, law=law))
        for i in range(3):
            key, count = jax.random.PRNGKey(10 + i), jnp.asarray(120, jnp.int32)
            want = np.asarray(draw(key, full, count))
            np.testing.assert_array_equal(np.asarray(draw(key, light, count)), want)
            assert (want != N * M).sum() > 50


def _assert_tables_are_the_weights(plan, q, s, k):
    """An independent reference for a plan's four search tables, in float64 from the
    memberships: the key CDF of cluster v sums z_jv over the keys, the row CDF of row i
    sums (Y Sbar)_iv sum_j z_jv over the clusters (Sbar: S with delta appended on the
    diagonal), and guide entry t counts the CDF entries at or below t * total / G."""
    q, s, k = (np.asarray(a, np.float64) for a in (q, s, k))
    y = q * Q_MASK[:, None]
    z = np.concatenate([k * K_MASK[:, None], K_MASK[:, None]], axis=1)  # [M, K + 1]
    y_sbar = np.concatenate([y @ s, (Q_MASK * DELTA)[:, None]], axis=1)  # [N, K + 1]
    want_z = np.cumsum(z, axis=0).T  # [K + 1, M]
    want_rows = np.cumsum(y_sbar * z.sum(axis=0)[None, :], axis=1)  # [N, K + 1]
    np.testing.assert_allclose(plan.zcdf, want_z, rtol=2e-6, atol=1e-7, err_msg="zcdf")
    np.testing.assert_allclose(plan.row_cdf, want_rows, rtol=2e-6, atol=1e-7, err_msg="row_cdf")
    for cdf, guide, span in (
        (plan.zcdf, plan.zguide, GUIDE_SPAN),
        (plan.row_cdf, plan.row_guide, ROW_GUIDE_SPAN),
    ):
        cdf = np.asarray(cdf)
        g = max(1, cdf.shape[1] // span)
        cuts = np.arange(g + 1, dtype=np.float32)[None, :] * cdf[:, -1:] / np.float32(g)
        below = (cdf[:, None, :] <= cuts[:, :, None]).sum(axis=2)
        np.testing.assert_array_equal(guide, np.minimum(below, cdf.shape[1] - 1))


def test_prefix_steps_give_the_same_keys_bit_for_bit(monkeypatch):
    # The work after the draw on the smallest static prefix of the slots that holds every
    # draw (a lax.switch): the same keys as on all the slots, for totals below, on and
    # past each prefix size, past the capacity (overflow), with and without forced edges.
    import sbm_jax.fastrg as fr
    import sbm_jax.fastrg.sampler as sampler  # the module whose constants prefix_sizes reads
    from sbm_jax.attention.sbm import forced_edge_keys

    q, s, k = _sbm(0.8)
    forced = forced_edge_keys(jnp.asarray(Q_MASK), jnp.asarray(K_MASK), self_loops=True, window=4)
    # (read when jit traces) prefixes of 112, 208, 304 and 400 slots
    monkeypatch.setattr(sampler, "PREFIX_ALIGN", 16)
    monkeypatch.setattr(sampler, "PREFIX_MIN_CAPACITY", 0)
    assert fr.prefix_sizes(400, 4) == (112, 208, 304, 400)
    for law in ("bernoulli", "poisson"):
        plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law=law)
        for fk in (None, forced):
            draw = {
                steps: jax.jit(
                    functools.partial(
                        fr.sample_edge_keys,
                        capacity=400,
                        law=law,
                        forced_keys=fk,
                        prefix_steps=steps,
                    )
                )
                for steps in (1, 4)
            }
            for i, total in enumerate((0, 5, 112, 113, 250, 400, 460)):
                key, count = jax.random.PRNGKey(i), jnp.asarray(total, jnp.int32)
                want = np.asarray(draw[1](key, plan, count))
                got = np.asarray(draw[4](key, plan, count))
                np.testing.assert_array_equal(got, want, err_msg=f"{law} {total}")
                assert (want != N * M).sum() >= min(total, 5)


def test_prefix_sizes():
    from sbm_jax.fastrg import PREFIX_ALIGN as A
    from sbm_jax.fastrg import PREFIX_MIN_CAPACITY, prefix_sizes

    c = 4 * A * -(-PREFIX_MIN_CAPACITY // A)  # a multiple of 4 A, at least the minimum
    q = c // 4
    assert prefix_sizes(c, 1) == (c,)
    assert prefix_sizes(c, 2) == (2 * q, c)
    assert prefix_sizes(c, 4) == (q, 2 * q, 3 * q, c)
    assert prefix_sizes(c + 1, 2) == (2 * q + A, c + 1)  # rounded up to a multiple of A
    small = PREFIX_MIN_CAPACITY - 1
    assert prefix_sizes(small, 4) == (small,)  # below the minimum: not cut
    with pytest.raises(ValueError, match="prefix_steps must be >= 1"):
        prefix_sizes(c, 0)


def _cdf_cases():
    rng = np.random.default_rng(3)
    length = 50
    cases = [
        rng.random(length),  # spread weights
        np.r_[np.zeros(20), rng.random(30)],  # leading zero-weight keys (masked tokens)
        np.r_[rng.random(10) * 1e-6, np.ones(1), rng.random(39) * 1e-6],  # one key dominates
        np.r_[rng.random(25), np.zeros(20), rng.random(5)],  # a flat run in the middle
        np.r_[np.zeros(49), np.ones(1)],  # all mass on the last key
    ]
    return np.cumsum(np.stack(cases), axis=1).astype(np.float32)


def _on_the_cut_points(total: float, length: int, span: int) -> np.ndarray:
    """A CDF row of ``length`` entries ending at ``total``, its entries on the guide's cut
    points and one float32 step either side of them (where rounding decides)."""
    g = length // span
    cuts = np.arange(g + 1, dtype=np.float32) * np.float32(total) / np.float32(g)
    near = np.concatenate([cuts, np.nextafter(cuts, 0), np.nextafter(cuts, np.inf)])
    # (no subnormals: XLA's CPU backend flushes them to zero, numpy does not)
    normal = (near == 0) | (near >= np.finfo(np.float32).tiny)
    near = np.unique(near[normal & (near < np.float32(total))])
    pick = near[np.linspace(0, near.size - 1, length - 1).astype(int)]
    return np.r_[np.sort(pick), np.float32(total)][None].astype(np.float32)


@pytest.mark.parametrize("span", [1, 3, ROW_GUIDE_SPAN, GUIDE_SPAN])
def test_guide_table_is_a_search_of_each_cut_point(span):
    from sbm_jax.fastrg.search import _guide_marks, _guide_table

    rng = np.random.default_rng(5)
    cases = np.concatenate(
        [
            _cdf_cases(),
            np.zeros((1, 50), np.float32),  # a row without weight
            # weights on a grid: many entries fall exactly on a cut point
            np.cumsum(rng.integers(0, 3, (3, 50)), axis=1).astype(np.float32),
            np.cumsum(rng.random((3, 50)) ** 6 * 1e-3, axis=1).astype(np.float32),
            _on_the_cut_points(0.7, 50, span),  # where the estimate t_j needs its correction
            _on_the_cut_points(1e-30, 50, span),
        ]
    )
    cdf = jnp.asarray(cases)
    got = np.asarray(jax.jit(_guide_table, static_argnums=1)(cdf, span))
    marks = np.asarray(_guide_marks(cdf, span))
    # Reference: numpy's search of every cut point (first j with cdf[j] > cut), capped.
    want = np.stack(
        [np.searchsorted(c, t, side="right") for c, t in zip(cases, marks, strict=True)]
    )
    np.testing.assert_array_equal(got, np.minimum(want, cases.shape[1] - 1))


def test_guide_table_under_nested_vmap_is_the_table_of_each_row():
    """The layer builds its plans under vmap over (example, head); the guide's batching
    rule folds those axes into rows. Reference: numpy's search of each row's cut points."""
    from sbm_jax.fastrg.search import _guide_marks, _guide_table

    rng = np.random.default_rng(11)
    weights = rng.random((2, 3, 5, 64)) ** 4
    weights[0, 1, 2] = 0.0  # a row without weight
    weights[1, 2, :, :30] = 0.0  # leading zero-weight keys
    cdf = np.cumsum(weights, axis=-1).astype(np.float32)
    for span in (4, GUIDE_SPAN):
        table = jax.jit(jax.vmap(jax.vmap(lambda c, s=span: _guide_table(c, s))))
        got = np.asarray(table(jnp.asarray(cdf)))
        flat = cdf.reshape(-1, cdf.shape[-1])
        marks = np.asarray(_guide_marks(jnp.asarray(flat), span))
        pairs = zip(flat, marks, strict=True)
        want = np.stack([np.searchsorted(c, t, side="right") for c, t in pairs])
        want = np.minimum(want, cdf.shape[-1] - 1).reshape(got.shape)
        np.testing.assert_array_equal(got, want)
        # and one vmap level (the rule with an unbatched inner call)
        one = np.asarray(jax.vmap(lambda c, s=span: _guide_table(c, s))(jnp.asarray(cdf[0])))
        np.testing.assert_array_equal(one, want[0])


# None: the default, GUIDE_SPAN (the key guide); ROW_GUIDE_SPAN: the cluster guide.
# window: entries read at once before bisection (0: bisection alone; 1 and 3: most
# brackets outgrow the window, so the bisection finishes them).
@pytest.mark.parametrize(
    ("span", "window"),
    [(None, SEARCH_WINDOW), (1, SEARCH_WINDOW), (ROW_GUIDE_SPAN, ROW_SEARCH_WINDOW)]
    + [(None, 0), (None, 1), (ROW_GUIDE_SPAN, 3)],
)
def test_guided_search_is_the_plain_inverse_cdf(span, window):
    from sbm_jax.fastrg.search import _below, _guide_table, _search_guided

    cdf = jnp.asarray(_cdf_cases())

    @jax.jit  # one program, not op-by-op compiles
    def setup(cdf):
        table = _guide_table(cdf) if span is None else _guide_table(cdf, span)
        rows = jnp.repeat(jnp.arange(cdf.shape[0]), 4000)
        u = jax.random.uniform(jax.random.PRNGKey(0), rows.shape)
        # Also the cut points themselves and the largest target below each total.
        edges = jnp.concatenate([jnp.linspace(0, 1, 101)] * cdf.shape[0])
        rows = jnp.concatenate([rows, jnp.repeat(jnp.arange(cdf.shape[0]), 101)])
        return table, rows, _below(cdf[rows, -1], jnp.concatenate([u, edges]))

    table, rows, targets = setup(cdf)
    assert table.shape == (cdf.shape[0], cdf.shape[1] // (span or GUIDE_SPAN) + 1)
    search = jax.jit(functools.partial(_search_guided, window=window))
    got = np.asarray(search(cdf, table, rows, targets))
    # Reference: numpy's searchsorted on each row (first j with cdf[j] > target).
    c, t, r = np.asarray(cdf), np.asarray(targets), np.asarray(rows)
    want = np.array([np.searchsorted(c[i], x, side="right") for i, x in zip(r, t, strict=True)])
    np.testing.assert_array_equal(got, want)
    # The chosen key always has weight (a zero-weight key is never drawn).
    prev = np.where(got > 0, c[r, np.maximum(got - 1, 0)], 0.0)
    assert np.all(c[r, got] > prev)


def test_slot_rows_repeat_each_row_by_its_count():
    from sbm_jax.fastrg.sampler import _slot_rows

    counts = np.array([0, 3, 0, 0, 2, 5, 0, 1], np.int32)
    n = counts.size
    slot_rows = jax.jit(_slot_rows, static_argnums=1)
    for capacity in (20, 11, 6):  # room to spare, exactly full, too small
        got = np.asarray(slot_rows(jnp.asarray(counts), capacity))
        want = np.r_[np.repeat(np.arange(n), counts), np.full(capacity, n)][:capacity]
        np.testing.assert_array_equal(got, want)


def test_split_count_is_multinomial_over_row_rates():
    from sbm_jax.fastrg import draw_row_counts, split_count

    q, s, k = _sbm(0.8)
    plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="bernoulli")
    keys = jax.random.split(jax.random.PRNGKey(1), 2000)
    split = np.asarray(jax.jit(jax.vmap(lambda kk: split_count(kk, plan, 60)))(keys))
    assert np.all(split.sum(1) == 60) and np.all(split[:, ~Q_MASK] == 0)
    rate = np.asarray(plan.row_rate, np.float64)
    share = rate / rate.sum()
    # Multinomial means and standard errors per row.
    se = np.sqrt(60 * share * (1 - share) / len(keys))
    assert np.all(np.abs(split.mean(0) - 60 * share) < 6 * se + 1e-9)
    per_row = np.asarray(jax.jit(jax.vmap(lambda kk: draw_row_counts(kk, plan)))(keys))
    # Independent Poisson counts: mean and variance both equal the row rate.
    np.testing.assert_allclose(per_row.mean(0), rate, atol=6 * np.sqrt(rate.max() / len(keys)))
    np.testing.assert_allclose(float(rate.sum()), float(plan.expected_draws), rtol=1e-5)


@pytest.mark.parametrize("budget", [None, 0.4, 0.01])
def test_thinning_matches_the_keep_probability_on_every_path(budget):
    # 0.4: the needed p_e fit the gathered slots; 0.01: they do not (full computation).
    from sbm_jax.fastrg.sampler import _thin

    q, s, k = _sbm(0.8)
    plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="bernoulli")
    rng = np.random.default_rng(5)
    real = np.flatnonzero((Q_MASK[:, None] & K_MASK[None, :]).reshape(-1)).astype(np.int32)
    keys = np.r_[real, np.full(64, N * M, np.int32)]  # every real pair, then empty slots
    keep = keys != N * M
    rows, cols = keys[keep] // M, keys[keep] % M
    # Reference in float64: keep iff u < r / (1 - exp(-c_i r)), r = p + delta.
    r = _dense_p(q, s, k)[rows, cols] + DELTA
    c = np.asarray(plan.oversample, np.float64)[rows]
    accept = r / -np.expm1(-c * r)
    thin = jax.jit(lambda u: _thin(plan, jnp.asarray(keys), jnp.asarray(keep), u, M, budget))
    needed = []
    for _ in range(20):
        u = rng.random(keys.size).astype(np.float32)
        got = np.asarray(thin(jnp.asarray(u)))
        assert not got[~keep].any()
        clear = np.abs(u[keep] - accept) > 1e-5  # float32 ties are left out
        np.testing.assert_array_equal(got[keep][clear], (u[keep] < accept)[clear])
        needed.append(int(np.sum(u[keep] * c >= 1)))
    assert min(needed) > 2, "the case should need p_e on some slots"
    if budget == 0.4:
        assert max(needed) <= 0.4 * keys.size, "this budget should take the gathered path"


def test_counts_on_rows_without_weight_give_no_edges():
    from sbm_jax.fastrg import sample_edge_keys

    q, s, k = _sbm(0.8)
    plan = _make_plan(q, s, k, delta=DELTA, q_mask=Q_MASK, k_mask=K_MASK, law="poisson")
    counts = np.zeros((N,), np.int32)
    counts[N - 1], counts[0] = 5, 3  # row N-1 is masked
    sample = jax.jit(functools.partial(sample_edge_keys, capacity=10))
    keys = np.asarray(sample(jax.random.PRNGKey(0), plan, jnp.asarray(counts)))
    rows = keys[keys != N * M] // M
    assert rows.size > 0 and np.all(rows == 0)


def test_edge_probs_straight_through_with_one_edge_list_shared_across_a_mapped_axis():
    # One edge list (rows, cols, valid unbatched) for several graphs (ys, z batched):
    # each graph's gradient is its own, not the sum over the mapped axis.
    from sbm_jax.fastrg import edge_probs_straight_through

    rows = jnp.array([0, 0, 1, 2, 2], jnp.int32)
    cols = jnp.array([1, 2, 0, 0, 2], jnp.int32)
    valid = jnp.array([True, True, True, True, False])
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    ys = jax.random.uniform(ks[0], (4, 3, 2))  # 4 graphs, n=3, k=2
    z = jax.random.uniform(ks[1], (4, 3, 3))  # m=3, K=k+1
    w = jax.random.normal(ks[2], (4, 5))

    def loss(ys, z):
        one = lambda a, b, ww: edge_probs_straight_through(a, b, rows, cols, valid) * ww  # noqa: E731
        return jnp.sum(jax.vmap(one)(ys, z, w))

    def reference(ys, z):  # sum over graphs of w_e * p_e, p_e = ys[row] . z[col, :k]
        p = jnp.einsum("grk,grk->gr", ys[:, rows], z[:, cols, :2])
        return jnp.sum(jnp.where(valid, p, 0.0) * w)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(ys, z)
    want = jax.jit(jax.grad(reference, argnums=(0, 1)))(ys, z)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(got[1])[..., 2] == 0.0), "the exploration column gets none"
    fwd = jax.jit(jax.vmap(lambda a, b: edge_probs_straight_through(a, b, rows, cols, valid)))(
        ys, z
    )
    np.testing.assert_array_equal(fwd, jnp.broadcast_to(valid.astype(jnp.float32), (4, 5)))


@pytest.mark.parametrize("method", ["scan", "parallel"])
@pytest.mark.parametrize("length", [1, 7, 129, 256, 257, 1000, 4096])
def test_weight_cdf_is_monotone_flat_on_zero_weights_and_the_prefix_sums(length, method):
    """The inverse-CDF searches need prefix sums that never decrease and do not move
    across a zero weight (a padded key must carry no mass). Reference: float64 cumsum,
    under jit and nested vmap, weights on either axis, both methods (CPU's sequential
    sums; the accelerators' cumsum with its exact fix-ups)."""
    weight_cdf = functools.partial(fastrg.weight_cdf, method=method)

    rng = np.random.default_rng(length)
    w = (rng.random((2, 3, length, 5)) ** 3).astype(np.float32)
    w[rng.random(w.shape) < 0.3] = 0.0
    w[:, :, -length // 4 :] = 0.0  # a padded tail
    w[0, 0] = 0.0  # a plan without weight
    for axis in (0, 1):
        x = w if axis == 0 else np.swapaxes(w, 2, 3)
        got = np.asarray(jax.jit(jax.vmap(jax.vmap(lambda a, ax=axis: weight_cdf(a, ax))))(x))
        step = np.diff(got, axis=2 + axis, prepend=0.0)
        zero = x == 0
        assert np.all(step >= 0), "a prefix below the one before it"
        assert np.all(step[zero] == 0), "a zero weight moved the CDF"
        want = np.cumsum(x.astype(np.float64), axis=2 + axis)
        total = np.max(want, axis=2 + axis, keepdims=True)
        assert np.all(np.abs(got - want) <= 1e-6 * total), np.max(np.abs(got - want) / total)


@pytest.mark.parametrize("method", ["scan", "parallel"])
def test_plan_gives_padded_keys_and_empty_clusters_no_mass(monkeypatch, method):
    """A key that is padding has no memberships: its step in every cluster's key CDF
    must be exactly 0, or fastRG could draw it as an edge. With jnp.cumsum (XLA's
    blocked rewrite) ~30 padded keys per plan carried up to 7e-8 of their cluster.
    Both of weight_cdf's methods (the plan uses the backend's: see cdf_method)."""
    monkeypatch.setattr(fastrg.search, "cdf_method", lambda: method)  # where weight_cdf reads it
    # A fresh jit: the module's _make_plan may have traced with the other method.
    plan_fn = jax.jit(lambda *a, **kw: make_plan(*a, **kw))
    rng = np.random.default_rng(3)
    n = m = 4096
    k = 128
    y = jax.nn.sigmoid(jnp.asarray(rng.normal(-2, 1, (n, k)), jnp.float32))
    z = jax.nn.sigmoid(jnp.asarray(rng.normal(-2, 1, (m, k)), jnp.float32))
    block = jax.nn.sigmoid(jnp.asarray(rng.normal(-3, 1, (k, k)), jnp.float32))
    k_mask = np.arange(m) < 3000
    k_mask[rng.random(m) < 0.1] = False  # padding inside the sequence too
    plan = plan_fn(y, block, z, q_mask=jnp.asarray(k_mask), k_mask=jnp.asarray(k_mask))
    zcdf = np.asarray(plan.zcdf)  # [K, m]
    steps = np.diff(zcdf, axis=1, prepend=0.0)
    assert np.all(steps[:, ~k_mask] == 0)
    assert np.all(steps >= 0)
    # delta = 0: the last cluster (delta's) has no weight in any row's cluster CDF.
    row_cdf = np.asarray(plan.row_cdf)
    assert np.all(row_cdf[:, -1] == row_cdf[:, -2])
    assert np.all(np.diff(row_cdf, axis=1) >= 0)


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_plan_sums_its_cdfs_without_loops_on_accelerators(monkeypatch, backend):
    """On a GPU each step of a sequential loop costs a kernel launch and a predicate
    read back: the plan (built every step, for every head) must not hold one there. On
    CPU its CDFs are sequential scans (faster there). The jaxpr the plan traces to on
    each backend, with weights long enough for the blocked scan."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.random((300, 8)), jnp.float32)
    z = jnp.asarray(rng.random((300, 8)), jnp.float32)
    block = jnp.asarray(rng.random((8, 8)), jnp.float32) * 0.1
    jaxpr = str(jax.make_jaxpr(lambda a, b, c: make_plan(a, b, c))(y, block, z))
    loops = jaxpr.count("scan[") + jaxpr.count("while[")
    assert loops == (3 if backend == "cpu" else 0), jaxpr
