"""Edge attention against the dense masked reference; the STE against eq. 9 densely."""

import jax
import jax.numpy as jnp
import numpy as np

from sbm_jax import EdgeList, dense_masked_attention, edge_attention, straight_through

N, M, D, DV = 9, 7, 4, 3


def _edges_from_mask(mask: np.ndarray, capacity: int) -> EdgeList:
    rows, cols = np.nonzero(mask)  # row-major: sorted by (row, col)
    e = len(rows)
    pad = capacity - e
    return EdgeList(
        rows=jnp.asarray(np.concatenate([rows, np.full(pad, N - 1)]), jnp.int32),
        cols=jnp.asarray(np.concatenate([cols, np.arange(pad) % M]), jnp.int32),
        valid=jnp.asarray(np.arange(capacity) < e),
        probs=jnp.asarray(np.zeros(capacity, np.float32)),
    )


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    mask = rng.random((N, M)) < 0.4
    mask[2] = False  # an empty row
    mask[5] = False
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (N, D))
    k = jax.random.normal(ks[1], (M, D))
    v = jax.random.normal(ks[2], (M, DV))
    p = jax.random.uniform(ks[3], (N, M))
    return mask, q, k, v, p


def _naive(q, k, v, mask, scale):
    # Plain numpy loops: softmax of q_i.k_j/sqrt(d)*scale_ij over the allowed j.
    q, k, v, scale = (np.asarray(a, np.float64) for a in (q, k, v, scale))
    out = np.zeros((q.shape[0], v.shape[1]))
    for i in range(q.shape[0]):
        js = np.nonzero(mask[i])[0]
        if len(js) == 0:
            continue
        s = np.array([q[i] @ k[j] / np.sqrt(q.shape[1]) * scale[i, j] for j in js])
        w = np.exp(s - s.max())
        out[i] = (w / w.sum()) @ v[js]
    return out


def test_forward_matches_dense_and_naive():
    mask, q, k, v, p = _setup()
    edges = _edges_from_mask(mask, capacity=N * M)
    scale = jnp.asarray(np.asarray(p)[np.asarray(edges.rows), np.asarray(edges.cols)])
    out_e, out_d = jax.jit(  # one program, not op-by-op compiles
        lambda q, k, v, edges, scale, mask, p: (
            edge_attention(q, k, v, edges, edge_scale=scale),
            dense_masked_attention(q, k, v, mask, scale=p),
        )
    )(q, k, v, edges, scale, jnp.asarray(mask), p)
    ref = _naive(q, k, v, mask, p)
    np.testing.assert_allclose(out_e, ref, atol=1e-5)
    np.testing.assert_allclose(out_d, ref, atol=1e-5)
    assert np.all(np.asarray(out_e)[[2, 5]] == 0.0), "rows with no edge output exactly 0"


def test_gradients_match_dense():
    mask, q, k, v, p = _setup(1)
    edges = _edges_from_mask(mask, capacity=N * M + 5)
    r, c = np.asarray(edges.rows), np.asarray(edges.cols)
    w = jax.random.normal(jax.random.PRNGKey(9), (N, DV))

    def loss_edges(q, k, v, p):
        return jnp.sum(w * edge_attention(q, k, v, edges, edge_scale=p[r, c]))

    def loss_dense(q, k, v, p):
        return jnp.sum(w * dense_masked_attention(q, k, v, jnp.asarray(mask), scale=p))

    ge = jax.jit(jax.grad(loss_edges, argnums=(0, 1, 2, 3)))(q, k, v, p)
    gd = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2, 3)))(q, k, v, p)
    for a, b in zip(ge, gd, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert np.all(np.asarray(ge[3])[~mask] == 0.0), "unsampled pairs get no gradient"


def test_invalid_slots_contribute_nothing():
    mask, q, k, v, p = _setup(2)
    edges = _edges_from_mask(mask, capacity=N * M + 8)
    # Scribble over empty slots' columns: nothing may change, and their scale gets 0 grad.
    nv = int(mask.sum())
    cols = np.asarray(edges.cols)
    cols2 = jnp.asarray(np.concatenate([cols[:nv], (cols[nv:] * 3 + 1) % M]))
    edges2 = edges.replace(cols=cols2)
    scale = jnp.asarray(np.linspace(0.5, 1.5, edges.capacity, dtype=np.float32))

    def f(scale, e):
        return jnp.sum(edge_attention(q, k, v, e, edge_scale=scale) ** 2)

    # One jitted f for both edge lists (same shapes: one compile), one for the gradient.
    f_jit = jax.jit(f)
    np.testing.assert_array_equal(f_jit(scale, edges), f_jit(scale, edges2))
    g = jax.jit(jax.grad(f))(scale, edges2)
    assert np.all(np.asarray(g)[nv:] == 0.0)


def test_ste_gradient_is_eq9():
    # Eq. 9: dL/dp_ij = dL/dA_ij * s_ij for sampled (i, j), where A = M (.) s and the
    # forward pass uses the binary mask. Reference: differentiate a dense computation
    # with respect to a continuous mask value m_ij at m = 1 on the sampled entries.
    mask, q, k, v, p = _setup(3)
    edges = _edges_from_mask(mask, capacity=N * M)
    r, c = np.asarray(edges.rows), np.asarray(edges.cols)
    w = jax.random.normal(jax.random.PRNGKey(4), (N, DV))

    @jax.jit  # one program, not op-by-op compiles
    def loss_ste(p):
        scale = straight_through(p[r, c])
        return jnp.sum(w * edge_attention(q, k, v, edges, edge_scale=scale))

    def loss_cont(mvals):
        return jnp.sum(w * dense_masked_attention(q, k, v, jnp.asarray(mask), scale=mvals))

    g_ste = jax.jit(jax.grad(loss_ste))(p)
    g_ref = np.asarray(jax.jit(jax.grad(loss_cont))(jnp.ones((N, M)))) * mask
    np.testing.assert_allclose(g_ste, g_ref, atol=1e-5)
    # Forward value is the binary-mask attention, untouched by p.
    np.testing.assert_allclose(loss_ste(p), loss_ste(np.asarray(p) * 0.1), rtol=1e-6)

    # And the hand-written form: dL/dA_ij * s_ij with s = q k^T / sqrt(d).
    s = np.asarray(jax.jit(lambda q, k: q @ k.T)(q, k)) / np.sqrt(D)

    def loss_a(a):
        masked = jnp.where(jnp.asarray(mask), a, -jnp.inf)
        att = jnp.where(jnp.asarray(mask), jax.nn.softmax(masked, axis=-1), 0.0)
        att = jnp.nan_to_num(att)
        return jnp.sum(w * (att @ v))

    d_a = jax.jit(jax.grad(loss_a))(jnp.asarray(s * mask))
    np.testing.assert_allclose(g_ste, np.asarray(d_a) * s * mask, atol=1e-5)


def test_straight_through_forward_is_one():
    p = jnp.array([0.1, 0.7, 0.0])
    np.testing.assert_array_equal(straight_through(p), jnp.ones(3))
    g = jax.grad(lambda p: jnp.sum(straight_through(p) * jnp.array([2.0, 3.0, 4.0])))(p)
    np.testing.assert_array_equal(g, jnp.array([2.0, 3.0, 4.0]))


def test_straight_through_keeps_each_mapped_gradient_its_own():
    # Under vmap (the layer maps over examples and heads) each row's p must get its own
    # cotangent, not the sum over rows: the loss is separable, so the answer is w.
    p = jnp.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    w = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

    def loss(p):
        return jnp.sum(jax.vmap(lambda a, b: straight_through(a) * b)(p, w))

    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(p), w)
    nested = jax.vmap(jax.vmap(lambda a, b: straight_through(a) * b))
    g = jax.jit(jax.grad(lambda p: jnp.sum(nested(p[None], w[None]))))(p)
    np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(jax.jit(jax.vmap(straight_through))(p), np.ones(p.shape))


def test_edge_attention_under_vmap_and_jit():
    mask, q, k, v, p = _setup(5)
    edges = _edges_from_mask(mask, capacity=N * M)
    batched = jax.tree.map(lambda a: jnp.stack([a, a]), edges)
    out = jax.jit(jax.vmap(lambda e: edge_attention(q, k, v, e)))(batched)
    ref = dense_masked_attention(q, k, v, jnp.asarray(mask))
    np.testing.assert_allclose(out[1], ref, atol=1e-5)


def test_operands_that_do_not_fit_the_graph_are_named():
    """The sampler records the graph's n and m: q, k or a per-slot array of another size
    is a ValueError before tracing (under jit a stray index would be clamped or dropped
    silently), for the reference and for the rows kernel. A hand-made EdgeList without
    n and m is still accepted."""
    import pytest

    from sbm_jax import sample_sbm_graph

    n, k = 16, 4
    memberships = jnp.full((n, k), 0.5)
    edges = sample_sbm_graph(
        jax.random.PRNGKey(0), memberships, jnp.full((k, k), 1 / 16), memberships, capacity=256
    )
    assert (edges.num_rows, edges.num_cols) == (n, n)
    x = jnp.ones((n, 4))
    for impl in ("segment", "rows"):
        with pytest.raises(ValueError, match="q has 8 rows but the graph was sampled for 16"):
            edge_attention(x[:8], x, x, edges, impl=impl)
        with pytest.raises(ValueError, match="k has 4 rows but the graph was sampled for 16"):
            edge_attention(x, x[:4], x[:4], edges, impl=impl)
        with pytest.raises(ValueError, match=r"edge_scale must be \[C\] = \[256\]"):
            edge_attention(x, x, x, edges, impl=impl, edge_scale=jnp.ones((3,)))
        with pytest.raises(ValueError, match=r"edge_bias must be \[C\] = \[256\]"):
            edge_attention(x, x, x, edges, impl=impl, edge_bias=jnp.ones((256, 1)))
        assert edge_attention(x, x, x, edges, impl=impl).shape == (n, 4)
    mask, q, kk, v, _ = _setup()
    out = edge_attention(q, kk, v, _edges_from_mask(mask, 64))
    assert out.shape == (N, DV)
