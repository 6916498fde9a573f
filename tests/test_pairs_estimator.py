"""The ``"pairs"`` estimator on an edge list (sbm_jax/kernels/pairs.py).

References are independent of the code under test: numpy float64 on the same mask with
every absent pair added to its row by hand (``tests.test_dense_path._numpy_reference``),
exact when every key is probed; with a few probes per row, the mean over many probe
draws against that exact value within a bound from the draws' own spread.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.edge_ops import edge_attention
from sbm_jax.fastrg import edge_probs_straight_through, edges_from_keys
from sbm_jax.kernels import pairs
from sbm_jax.kernels.pairs import probe_columns, with_absent_pairs
from tests.test_dense_path import K_MASK, Q_MASK, M, N, _f32, _inputs, _numpy_reference

C = 200  # slots: more than the edges drawn below


def _graph(seed, ys, zk):
    """A mask drawn with probabilities ``ys zk^T`` on real pairs (rows 3 and 11 empty, as
    ``_inputs`` zeroes them) and its sorted edge keys, sentinel ``N * M`` after them."""
    rng = np.random.default_rng(seed)
    p = ys @ zk.T
    mask = (rng.random((N, M)) < p) & Q_MASK[:, None] & K_MASK[None, :]
    rows, cols = np.nonzero(mask)
    keys = np.full(C, N * M, np.int32)
    keys[: rows.size] = rows * M + cols
    assert rows.size < C and mask[Q_MASK].any(1).sum() > 5
    return mask, jnp.asarray(keys)


def _loss_fn(keys, g, c, kernel, probes):
    masks = (jnp.asarray(Q_MASK), jnp.asarray(K_MASK))
    edges = edges_from_keys(keys, N, M)

    def loss(q, k, v, ys, zk, probe_key):
        m_ste = edge_probs_straight_through(ys, zk, edges.rows, edges.cols, edges.valid)
        out, lse = edge_attention(
            q, k, v, edges, edge_bias=m_ste - 1.0, impl=kernel, return_lse=True
        )
        out, count = with_absent_pairs(
            probe_key, q, k, v, out, lse, ys, zk, keys, *masks, probes=probes
        )
        return jnp.sum(out * jnp.asarray(g, jnp.float32)) + c * count, out

    return loss


@pytest.mark.parametrize("kernel", ["segment", "rows"])
def test_every_key_probed_matches_numpy_exactly(kernel):
    q, k, v, g, ys, zk = _inputs(3)
    mask, keys = _graph(0, ys, zk)
    c = 0.3
    loss = _loss_fn(keys, g, c, kernel, probes=M)
    (val, out), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(
        *_f32(q, k, v, ys, zk), jax.random.PRNGKey(0)
    )
    ref_out, ref_loss, ref_grads = _numpy_reference(q, k, v, g, ys, zk, mask, c, "pairs")
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val, ref_loss, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "ys", "zk"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)


def test_probes_walked_in_blocks_of_rows_match_numpy(monkeypatch):
    # Blocks of 4 query rows (the last one padded): the row-blocked backward must give
    # the exact values of one block over every row.
    q, k, v, g, ys, zk = _inputs(6)
    monkeypatch.setattr(pairs, "PROBE_BLOCK_ELEMENTS", 4 * M * ys.shape[1])
    assert N % 4 != 0
    mask, keys = _graph(2, ys, zk)
    loss = _loss_fn(keys, g, 0.3, "rows", probes=M)
    # (jit traces here, under the patched block size)
    grads = jax.jit(jax.grad(loss, argnums=range(5), has_aux=True))(
        *_f32(q, k, v, ys, zk), jax.random.PRNGKey(0)
    )[0]
    _, _, ref_grads = _numpy_reference(q, k, v, g, ys, zk, mask, 0.3, "pairs")
    for name, a, b in zip(("q", "k", "v", "ys", "zk"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)


def test_few_probes_are_unbiased():
    q, k, v, g, ys, zk = _inputs(4)
    mask, keys = _graph(1, ys, zk)
    loss = _loss_fn(keys, g, 0.0, "segment", probes=3)
    grad_ys = jax.jit(jax.vmap(lambda key: jax.grad(loss, argnums=3, has_aux=True)(
        *_f32(q, k, v, ys, zk), key)[0]))  # fmt: skip
    draws = np.asarray(grad_ys(jax.random.split(jax.random.PRNGKey(5), 4000)), np.float64)
    _, _, ref = _numpy_reference(q, k, v, g, ys, zk, mask, 0.0, "pairs")
    mean, se = draws.mean(0), draws.std(0) / np.sqrt(draws.shape[0])
    assert se.max() > 1e-4, "with 3 probes per row the estimate should vary"
    np.testing.assert_array_less(np.abs(mean - ref[3]), 5.0 * se + 1e-5)


def test_probes_draw_real_keys_uniformly():
    k_mask = jnp.asarray(np.array([1, 0, 1, 1, 0, 0, 1, 1], bool))
    cols, weight = probe_columns(jax.random.PRNGKey(0), k_mask, 4000, 6)
    cols = np.asarray(cols)
    assert cols.shape == (4000, 6) and float(weight) == pytest.approx(5 / 6)
    counts = np.bincount(cols.ravel(), minlength=8)
    assert counts[~np.asarray(k_mask)].sum() == 0
    expected = cols.size / 5
    chi2 = np.sum((counts[np.asarray(k_mask)] - expected) ** 2 / expected)
    assert chi2 < 18.5  # chi-square, 4 degrees of freedom, p = 0.001
    every, w = probe_columns(jax.random.PRNGKey(0), k_mask, 3, 8)
    np.testing.assert_array_equal(every, np.tile(np.arange(8), (3, 1)))
    assert float(w) == 1.0


def test_under_vmap_every_graph_keeps_its_own_gradient():
    # On accelerators the layer maps its graphs with vmap: the zero output of the probe
    # term must stay batched, or its cotangent would arrive summed over the graphs.
    graphs = []
    for seed in (6, 7):
        q, k, v, g, ys, zk = _inputs(seed)
        graphs.append((_f32(q, k, v, g, ys, zk), _graph(seed, ys, zk)[1]))
    key = jax.random.PRNGKey(2)

    def grads(q, k, v, g, ys, zk, keys):
        loss = _loss_fn(keys, g, 0.2, "segment", probes=M)
        return jax.grad(loss, argnums=(3, 4), has_aux=True)(q, k, v, ys, zk, key)[0]

    stacked = [jnp.stack(parts) for parts in zip(*[(*a, b) for a, b in graphs], strict=True)]
    together = jax.jit(jax.vmap(grads))(*stacked)
    for i, (arrays, keys) in enumerate(graphs):
        alone = jax.jit(grads)(*arrays, keys)
        for a, b in zip(together, alone, strict=True):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)
