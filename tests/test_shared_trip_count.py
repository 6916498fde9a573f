"""Loops that follow the edges, under vmap: one trip count for all graphs, same results.

The rows kernel, the straight-through backward and fastRG's streamed searches loop only
over the chunks that hold edges. Under vmap (the layer's head mapping on accelerators)
they run to the largest count over the graphs, unbatched (sbm_jax._loops), instead of
letting JAX batch the trip count (a loop to the longest graph that selects every carry
on every step). Here graphs of very different sizes, cut into many small chunks, must
give what each graph gives alone, and the dense reference.
"""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import sbm_jax.fastrg as fr
import sbm_jax.fastrg.sampler as sampler
import sbm_jax.ste as ste
from sbm_jax import EdgeList, dense_masked_attention
from sbm_jax._loops import shared_trip_count
from sbm_jax.kernels import rows_edge_attention

N, M, D = 20, 17, 4


def test_shared_trip_count_is_the_largest_over_the_mapped_axes():
    counts = jnp.asarray([[3, 9, 1], [4, 0, 2]], jnp.int32)
    assert int(shared_trip_count(counts[0, 0])) == 3
    one = jax.vmap(shared_trip_count)(counts[0])
    np.testing.assert_array_equal(one, [9, 9, 9])
    nested = jax.jit(jax.vmap(jax.vmap(shared_trip_count)))(counts)
    np.testing.assert_array_equal(nested, np.full((2, 3), 9))
    # an unbatched count under vmap stays what it is
    np.testing.assert_array_equal(
        jax.vmap(lambda _: shared_trip_count(jnp.int32(5)))(jnp.arange(3)), [5, 5, 5]
    )


def _graph(seed: int, density: float, cap: int):
    rng = np.random.default_rng(seed)
    mask = rng.random((N, M)) < density
    mask[2] = False  # an empty row
    rows, cols = np.nonzero(mask)
    e = len(rows)
    pad = cap - e
    return mask, dict(
        rows=np.concatenate([rows, np.full(pad, N - 1)]).astype(np.int32),
        cols=np.concatenate([cols, rng.integers(0, M, pad)]).astype(np.int32),  # junk
        valid=np.arange(cap) < e,
    )


def _batch(densities, cap):
    graphs = [_graph(s, d, cap) for s, d in enumerate(densities)]
    masks = np.stack([m for m, _ in graphs])
    arrays = {k: np.stack([g[k] for _, g in graphs]) for k in ("rows", "cols", "valid")}
    return masks, arrays


def _while_conds(jaxpr):
    """The cond jaxprs of every while loop in ``jaxpr``, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            found.append(eqn.params["cond_jaxpr"].jaxpr)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_while_conds(sub))
    return found


def test_rows_kernel_under_vmap_gives_each_graph_its_own_result():
    # Densities 0.02 .. 0.9: with 4 slots per block the graphs hold from ~2 to ~80 live
    # blocks, so most graphs run many blocks past their own.
    masks, arrays = _batch((0.9, 0.02, 0.4, 0.1), cap=N * M)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (4, N, D))
    k = jax.random.normal(keys[1], (4, M, D))
    v = jax.random.normal(keys[2], (4, M, D))
    g = jax.random.normal(keys[3], (4, N, D))

    def one(q, k, v, rows, cols, valid):
        edges = EdgeList(rows=rows, cols=cols, valid=valid, probs=jnp.zeros(valid.shape))
        return rows_edge_attention(q, k, v, edges, slots_per_row=2, block_slots=4)

    def loss(q, k, v):
        out = jax.vmap(one)(q, k, v, *arrays.values())
        return jnp.sum(out * g), out

    def dense_loss(q, k, v):
        out = jax.vmap(dense_masked_attention)(q, k, v, jnp.asarray(masks))
        return jnp.sum(out * g), out

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(grad(loss))(q, k, v)
    (_, want), want_grads = jax.jit(grad(dense_loss))(q, k, v)
    np.testing.assert_allclose(out, want, atol=3e-6)
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, ref, atol=3e-6)
    assert np.all(np.asarray(out)[:, 2] == 0.0), "an empty row stays exactly 0"

    _assert_trip_counts_unbatched(jax.make_jaxpr(grad(loss))(q, k, v).jaxpr)


def _assert_trip_counts_unbatched(jaxpr, at_least: int = 1):
    # No loop counting blocks or chunks runs until all graphs are done: a batched trip
    # count shows as a while predicate with the mapped axis. Loops whose cond reduces a
    # batched predicate (reduce_or: the inverse-CDF bisections) are meant to.
    counting = [
        cond
        for cond in _while_conds(jaxpr)
        if "reduce_or" not in {e.primitive.name for e in cond.eqns}
    ]
    assert len(counting) >= at_least, "the counting loops are while loops"
    for cond in counting:
        (pred,) = cond.outvars
        assert pred.aval.shape == (), f"a counting loop's predicate is batched: {pred.aval}"


@pytest.mark.parametrize("chunk", [4, 64])
def test_straight_through_backward_under_vmap_with_chunks_per_graph(chunk, monkeypatch):
    # Graphs whose last edge sits in chunk 2 .. 40 of 4 slots: the closed form G Z, G^T Y.
    from sbm_jax.fastrg import edge_probs_straight_through

    rng = np.random.default_rng(3)
    heads, n, m, k, cap = 4, 12, 11, 3, 160
    ys = rng.random((heads, n, k)).astype(np.float32)
    z = rng.random((heads, m, k + 1)).astype(np.float32)
    rows = np.full((heads, cap), n - 1, np.int32)
    cols = np.zeros((heads, cap), np.int32)
    valid = np.zeros((heads, cap), bool)
    for h, size in enumerate((130, 5, 60, 17)):
        keys = np.sort(rng.choice(n * m, size=size, replace=False))
        rows[h, :size], cols[h, :size] = keys // m, keys % m
        valid[h, :size] = True
    w = rng.normal(size=(heads, cap)).astype(np.float32)
    monkeypatch.setattr(ste, "STE_CHUNK", chunk)  # read when jit traces
    monkeypatch.setattr(ste, "STE_CHUNK_ACCELERATOR", chunk)

    def loss(ys, z):
        s = jax.vmap(edge_probs_straight_through)(ys, z, rows, cols, valid)
        return jnp.sum(s * w)

    dys, dz = jax.jit(jax.grad(loss, argnums=(0, 1)))(ys, z)
    _assert_trip_counts_unbatched(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(ys, z).jaxpr)
    for h in range(heads):
        gm = np.zeros((n, m))
        np.add.at(gm, (rows[h][valid[h]], cols[h][valid[h]]), w[h][valid[h]])
        np.testing.assert_allclose(dys[h], gm @ z[h, :, :k].astype(np.float64), rtol=1e-5)
        np.testing.assert_allclose(dz[h, :, :k], gm.T @ ys[h].astype(np.float64), rtol=1e-5)
        assert np.all(np.asarray(dz[h, :, k:]) == 0.0)


def test_sampler_under_vmap_draws_what_each_graph_draws_alone(monkeypatch):
    # fastRG's streamed searches stop at each graph's draw count; under vmap at the
    # largest. The keys must be those of each graph sampled alone, bit for bit.
    monkeypatch.setattr(sampler, "SEARCH_CHUNK", 8)  # read when jit traces
    rng = np.random.default_rng(5)
    n, m, k, cap = 16, 15, 3, 96
    plans, counts = [], []
    for scale, draws in ((0.9, 90), (0.2, 6), (0.5, 40)):
        q = (rng.random((n, k)) * scale).astype(np.float32)
        kk = (rng.random((m, k)) * scale).astype(np.float32)
        s = np.full((k, k), 0.2, np.float32) + 0.6 * np.eye(k, dtype=np.float32)
        plan = fr.make_plan(jnp.asarray(q), jnp.asarray(s), jnp.asarray(kk), delta=0.01)
        plans.append(plan)
        counts.append(fr.split_count(jax.random.PRNGKey(draws), plan, draws))
    keys = jax.random.split(jax.random.PRNGKey(9), 3)
    sample = functools.partial(fr.sample_edge_keys, capacity=cap, thin_budget=None)
    batched = jax.jit(jax.vmap(sample))(
        keys, jax.tree.map(lambda *a: jnp.stack(a), *plans), jnp.stack(counts)
    )
    alone = [jax.jit(sample)(key, p, c) for key, p, c in zip(keys, plans, counts, strict=True)]
    for got, want in zip(batched, alone, strict=True):
        np.testing.assert_array_equal(got, want)
    assert len({int(np.sum(np.asarray(a) != n * m)) for a in alone}) == 3


def test_layer_on_accelerator_mapping_has_no_batched_trip_count(monkeypatch):
    # The whole SBM layer under grad, its graphs in one vmap as on GPU and TPU. Only the
    # inverse-CDF bisections may loop "until every graph is done" (their cond reduces a
    # batched predicate with reduce_or); a loop counting blocks or chunks must not.
    import sbm_jax.attention.sbm_core as sbm_core  # the module whose core reads it
    from sbm_jax.attention import get_attention

    monkeypatch.setattr(sbm_core, "sparse_heads_per_step", lambda backend=None: None)
    sbm_core._sbm_attention_core.clear_cache()  # no trace from before the patch
    try:
        layer = get_attention("sbm")(
            num_heads=2, head_dim=8, num_clusters=4, impl="sparse", kernel="rows"
        )
        x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 16))
        rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
        params = layer.init(rngs, x)["params"]

        def loss(params, x):
            out = layer.apply({"params": params}, x, rngs={"sample": jax.random.PRNGKey(3)})
            return jnp.sum(out)

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x).jaxpr
    finally:
        sbm_core._sbm_attention_core.clear_cache()
    _assert_trip_counts_unbatched(jaxpr, at_least=4)  # the kernel, STE and sampler loops
