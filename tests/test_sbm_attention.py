"""SBMAttention: path choice, same law on sparse and dense paths, density, padding, retracing."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax import SBMAttention
from sbm_jax.attention.registry import STATS_COLLECTION
from sbm_jax.attention.sbm import (
    bucket_capacities,
    choose_bucket,
    forced_edge_keys,
    forced_edge_mask,
    sampler_options,
    sbm_attention_core,
    sparse_heads_per_step,
)
from sbm_jax.fastrg import THIN_BUDGET, dense_probs, make_plan, prefix_sizes
from tests.sbm_testing import (
    dense_loss_on_masks,
    plans_and_counts,
    same_graphs_dense_loss,
    streamed_masks,
)

B, L, D = 2, 16, 8
MASK = jnp.arange(L)[None, :] < jnp.array([[16], [11]])


def _x(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, L, D))


def _module(**kw):
    # One sparse bucket keeps compile time down; the bucket test uses several. The
    # bucketed path (kernel "rows", the default off the CPU) unless a test says otherwise;
    # the CPU's default, the fused kernel, has its own tests in test_fused_kernel.py and
    # joins the layer-level tests below through their `kernel` parameter.
    base = dict(num_heads=2, head_dim=4, num_clusters=6, capacity_buckets=(0.5,), kernel="rows")
    base.update(kw)
    return SBMAttention(**base)


_PARAMS = {}


def _init(mod, x):
    # Parameter shapes depend only on the widths, so one dense-path init serves every
    # impl, law and bucket set (and the dense path compiles fastest).
    mod.validate()
    sig = (mod.num_heads, mod.head_dim, mod.num_clusters, mod.shared_mlp, x.shape)
    if sig not in _PARAMS:
        rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}
        # max_dense_elements is lifted too: a module that rules the dense path out has the
        # same parameters, and this test file must not depend on which test runs first.
        dense = mod.clone(impl="dense", max_dense_elements=2**31)
        _PARAMS[sig] = nn.unbox(dense.init(rngs, x, MASK))["params"]
    return _PARAMS[sig]


_APPLY = {}


def _apply(mod, params, x, key, deterministic=False, mask=MASK):
    """Jitted apply, compiled once per module configuration."""
    sig = (repr(mod), deterministic)
    if sig not in _APPLY:
        _APPLY[sig] = jax.jit(
            lambda params, x, mask, key: mod.apply(
                {"params": params},
                x,
                mask,
                deterministic=deterministic,
                rngs={"sample": key},
                mutable=[STATS_COLLECTION],
            )
        )
    return _APPLY[sig](params, x, mask, key)


def test_bucket_capacities_and_choice():
    caps = bucket_capacities((1 / 64, 1 / 16, 1 / 4), 64, 64)
    assert caps == (64, 256, 1024)
    for counts, want in [([3, 64], 0), ([65, 1], 1), ([256], 1), ([257], 2), ([1025], 3)]:
        assert int(choose_bucket(jnp.array(counts), caps)) == want
    assert int(choose_bucket(jnp.array([1]), caps, force_dense=True)) == 3


def test_layer_picks_smallest_bucket_that_fits():
    # Recompute the layer's plan outside it and check its recorded path against
    # the smallest bucket holding the largest Poisson draw.
    rng = np.random.default_rng(0)
    q_memb = jnp.asarray(rng.random((B, 2, L, 3)) * 0.3, jnp.float32)
    k_memb = jnp.asarray(rng.random((B, 2, L, 3)) * 0.3, jnp.float32)
    block = jnp.full((2, 3, 3), 1 / 9, jnp.float32)
    qkv = jnp.asarray(rng.normal(size=(B, 2, L, 4)), jnp.float32)
    buckets = (1 / 32, 1 / 8, 1 / 2)
    caps = bucket_capacities(buckets, L, L)
    core = jax.jit(
        lambda key: sbm_attention_core(
            key,
            qkv,
            qkv,
            qkv,
            q_memb,
            block,
            k_memb,
            MASK,
            delta=0.0,
            law="poisson",
            capacity_buckets=buckets,
            impl="sparse",
        )[1]
    )
    seen = set()
    for seed in range(12):
        key = jax.random.PRNGKey(seed)
        stats = core(key)
        counts = plans_and_counts(key, q_memb, block, k_memb, MASK, law="poisson", delta=0.0)[1]
        counts = np.asarray(counts).sum(-1)  # draws per graph
        want = int(np.sum(np.array(caps) < int(counts.max())))
        assert int(stats["path"]) == want
        assert not np.asarray(stats["overflow"]).any()
        seen.add(want)
    assert len(seen) >= 2, "the test should exercise more than one bucket"


def test_a_pair_probability_near_one_sends_the_layer_to_the_dense_path():
    # Bernoulli oversampling needs every row bound on p + delta below 0.995: one real pair
    # with p = 0.999 takes the batch to the dense path although its draws fit the largest
    # bucket; p = 0.9 does not, nor does 0.999 on a padded key. p from numpy below.
    block = jnp.broadcast_to(jnp.eye(3, dtype=jnp.float32), (2, 3, 3))
    qkv = jnp.asarray(np.random.default_rng(0).normal(size=(B, 2, L, 4)), jnp.float32)
    buckets = (1 / 32, 1 / 8, 1 / 2, 1.0)

    def path_for(top, example, key):
        q_memb = np.full((B, 2, L, 3), 0.05, np.float32)
        k_memb = q_memb.copy()
        q_memb[example, 1, 3] = (1.0, 0.0, 0.0)
        k_memb[example, 1, key] = (top, 0.0, 0.0)
        p = np.einsum("bhik,hkl,bhjl->bhij", q_memb, np.asarray(block), k_memb)
        real = np.asarray(MASK)[:, None, :, None] & np.asarray(MASK)[:, None, None, :]
        stats = sbm_attention_core(
            jax.random.PRNGKey(0), qkv, qkv, qkv, jnp.asarray(q_memb), block,
            jnp.asarray(k_memb), MASK, delta=0.0, law="bernoulli",
            capacity_buckets=buckets, impl="sparse",
        )[1]  # fmt: skip
        return int(stats["path"]), float(np.max(np.where(real, p, 0.0)))

    dense = len(buckets)
    path, p_max = path_for(0.999, example=0, key=7)
    assert p_max > 0.995 and path == dense
    path, p_max = path_for(0.9, example=0, key=7)
    assert p_max < 0.995 and path < dense
    path, p_max = path_for(0.999, example=1, key=13)  # key 13 is padding in example 1
    assert p_max < 0.995 and path < dense


def test_auto_cost_model_skips_costly_buckets():
    rng = np.random.default_rng(1)
    memb = jnp.asarray(rng.random((B, 2, L, 3)), jnp.float32)
    block = jnp.full((2, 3, 3), 1 / 9, jnp.float32)
    qkv = jnp.asarray(rng.normal(size=(B, 2, L, 4)), jnp.float32)

    def path(**kw):
        _, st = sbm_attention_core(
            jax.random.PRNGKey(0), qkv, qkv, qkv, memb, block, memb, MASK, delta=0.0, **kw
        )
        return int(st["path"])

    buckets = (1 / 32, 1 / 8)
    # Short sequences go dense; so do buckets whose edges cost more than n*m pairs.
    assert path(impl="auto", capacity_buckets=buckets, dense_below=L * L) == 2
    assert path(impl="auto", capacity_buckets=buckets, dense_below=0, edge_cost=1e6) == 2


def _mean_density(impl: str, law: str, trials: int):
    mod = _module(impl=impl, edge_law=law, delta=0.05)
    x = _x()
    params = _init(mod, x)
    fn = lambda key: _apply(mod, params, x, key)[1][STATS_COLLECTION]["density"][0]  # noqa: E731
    dens = np.stack([np.asarray(fn(k)) for k in jax.random.split(jax.random.PRNGKey(5), trials)])
    return dens, mod, params, x


@pytest.mark.parametrize("law", ["bernoulli", "poisson"])
def test_sparse_and_dense_paths_sample_the_same_law(law):
    trials = 60
    d_sparse, mod, params, x = _mean_density("sparse", law, trials)
    d_dense, _, _, _ = _mean_density("dense", law, trials)
    # Closed form: E[density] = mean over real pairs of the pair probability.
    qkv_memb = _memberships(mod, params, x)
    expected = _expected_density(*qkv_memb, law=law, delta=0.05)
    for d in (d_sparse, d_dense):
        se = d.std(0) / np.sqrt(trials) + 1e-3
        assert np.all(np.abs(d.mean(0) - expected) < 5 * se), (d.mean(0), expected)


def _memberships(mod, params, x):
    # Recompute the layer's memberships and block from its parameters (eqs. 5-7).
    return _memberships_of(params, x)


@jax.jit  # one program: run op by op, its ~40 operations would each compile alone
def _memberships_of(params, x):
    p = params
    q = jnp.einsum("bld,dhe->blhe", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = jnp.einsum("bld,dhe->blhe", x, p["key"]["kernel"]) + p["key"]["bias"]

    def mlp(t):
        h = jax.nn.relu(jnp.einsum("blhd,hde->blhe", t, p["mlp_w1"]) + p["mlp_b1"])
        return jnp.einsum("blhd,hde->blhe", h, p["mlp_w2"]) + p["mlp_b2"]

    c = p["clusters"]
    qm = jax.nn.sigmoid(jnp.einsum("blhd,hkd->bhlk", mlp(q), c))
    km = jax.nn.sigmoid(jnp.einsum("blhd,hkd->bhlk", mlp(k), c))
    kk = c.shape[1]
    s = jax.nn.softmax(jnp.einsum("hkd,hjd->hkj", c, c).reshape(-1, kk * kk), -1)
    return qm, s.reshape(-1, kk, kk), km


def _expected_density(qm, s, km, *, law, delta):
    qm, s, km = (np.asarray(a, np.float64) for a in (qm, s, km))
    mask = np.asarray(MASK)
    out = np.zeros(qm.shape[:2])
    for b in range(qm.shape[0]):
        real = mask[b][:, None] & mask[b][None, :]
        for h in range(qm.shape[1]):
            p = qm[b, h] @ s[h] @ km[b, h].T + delta
            prob = np.minimum(1, p) if law == "bernoulli" else 1 - np.exp(-p)
            out[b, h] = prob[real].mean()
    return out


@pytest.mark.parametrize("kernel", ["rows", "fused"])
def test_density_and_edges_are_consistent(kernel):
    mod = _module(impl="sparse", kernel=kernel)
    x = _x()
    params = _init(mod, x)
    _, state = _apply(mod, params, x, jax.random.PRNGKey(3))
    st = state[STATS_COLLECTION]
    real = np.asarray(MASK).sum(1).astype(float) ** 2
    np.testing.assert_allclose(
        np.asarray(st["density"][0]), np.asarray(st["edges"][0]) / real[:, None], rtol=1e-6
    )


@pytest.mark.parametrize("kernel", ["rows", "fused"])
def test_padding_never_changes_real_outputs(kernel):
    mod = _module(impl="sparse", kernel=kernel)
    x = _x()
    params = _init(mod, x)
    noise = jax.random.normal(jax.random.PRNGKey(9), x.shape) * 5
    x2 = jnp.where(MASK[..., None], x, noise)
    key = jax.random.PRNGKey(4)
    y1, s1 = _apply(mod, params, x, key)
    y2, s2 = _apply(mod, params, x2, key)
    m = np.asarray(MASK)
    np.testing.assert_allclose(np.asarray(y1)[m], np.asarray(y2)[m], atol=1e-5)
    np.testing.assert_array_equal(
        s1[STATS_COLLECTION]["edges"][0], s2[STATS_COLLECTION]["edges"][0]
    )


def test_no_retrace_across_batches():
    mod = _module()
    x = _x()
    params = _init(mod, x)
    traces = []

    @jax.jit
    def step(params, x, key):
        traces.append(1)
        y, _ = _apply(mod, params, x, key)
        return jnp.sum(y)

    for seed in range(4):
        step(params, _x(seed), jax.random.PRNGKey(seed)).block_until_ready()
    assert len(traces) == 1

    # Batches of the same shapes whose counts pick different capacity buckets: the path
    # is chosen on device under lax.switch, so neither the traced step nor the layer's
    # own jitted core (called eagerly, where a path chosen on the host as a static
    # argument would compile once per path) compiles again.
    from jax._src import dispatch, monitoring

    mod = _module(impl="sparse", delta=0.0, edge_law="poisson", capacity_buckets=(0.1, 0.4))
    params = _init(mod, x)
    batches = [(_x(0), 0), (_x(1), 1), (10.0 * _x(0), 0)]  # the last takes the 0.4 bucket
    paths = {
        int(_apply(mod, params, xb, jax.random.PRNGKey(s))[1][STATS_COLLECTION]["path"][0])
        for xb, s in batches
    }
    assert len(paths) == 2, paths
    compiles = []

    def listen(event, duration, **kw):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(event)

    def eager(xb, s):
        return mod.apply(
            {"params": params},
            xb,
            MASK,
            deterministic=False,
            rngs={"sample": jax.random.PRNGKey(s)},
            mutable=[STATS_COLLECTION],
        )

    jax.block_until_ready(eager(*batches[0]))  # warm: compiles the core once
    monitoring.register_event_duration_secs_listener(listen)
    try:
        for xb, s in batches[1:]:
            jax.block_until_ready(eager(xb, s))
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiles == [], f"{len(compiles)} compiles for batches on another path"


def test_eval_keeps_sampling_without_delta():
    mod = _module(impl="dense", delta=0.5)
    x = _x()
    params = _init(mod, x)
    dens = lambda det, seed: np.asarray(  # noqa: E731
        _apply(mod, params, x, jax.random.PRNGKey(seed), deterministic=det)[1][STATS_COLLECTION][
            "density"
        ][0]
    )
    train = np.mean([dens(False, s) for s in range(5)])
    evals = [dens(True, s) for s in range(5)]
    assert train > np.mean(evals) + 0.2, "delta=0.5 must raise training density only"
    assert not np.allclose(evals[0], evals[1]), "evaluation still samples"


@pytest.mark.parametrize("kernel", ["rows", "fused"])
def test_gradients_reach_sbm_parameters_and_are_finite(kernel):
    mod = _module(impl="sparse", kernel=kernel)
    x = _x()
    params = _init(mod, x)

    def loss(params):
        y, st = _apply(mod, params, x, jax.random.PRNGKey(2))
        return jnp.mean(y**2) + jnp.mean(st[STATS_COLLECTION]["density"][0])

    grads = jax.jit(jax.grad(loss))(params)
    for name in ("clusters", "mlp_w1", "mlp_w2", "query", "key", "value"):
        leaves = jax.tree.leaves(grads[name])
        assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
        assert any(np.abs(np.asarray(g)).sum() > 0 for g in leaves), name


def test_forced_edges_self_loops_and_window():
    qm = jnp.arange(6) < 5
    keys = np.asarray(forced_edge_keys(qm, qm, self_loops=False, window=2))
    dense = np.asarray(forced_edge_mask(qm, qm, self_loops=False, window=2))
    valid = keys[keys < 36]
    got = np.zeros((6, 6), bool)
    got[valid // 6, valid % 6] = True
    want = np.array([[abs(i - j) <= 1 and i < 5 and j < 5 for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dense, want)
    loops = np.asarray(forced_edge_mask(qm, qm, self_loops=True, window=0))
    np.testing.assert_array_equal(loops, np.diag(np.arange(6) < 5))


@pytest.mark.parametrize("kernel", ["rows", "fused"])
def test_self_loops_always_present(kernel):
    mod = _module(impl="sparse", kernel=kernel, self_loops=True, delta=0.0)
    x = _x()
    params = _init(mod, x)
    _, st = _apply(mod, params, x, jax.random.PRNGKey(1))
    real = np.asarray(MASK).sum(1)
    assert np.all(np.asarray(st[STATS_COLLECTION]["edges"][0]) >= real[:, None])


def test_dense_probs_match_memberships():
    mod = _module()
    x = _x()
    params = _init(mod, x)
    qm, s, km = _memberships(mod, params, x)
    plan = jax.jit(make_plan)(qm[1, 0], s[0], km[1, 0], q_mask=MASK[1], k_mask=MASK[1])
    want = np.asarray(qm[1, 0], np.float64) @ np.asarray(s[0], np.float64)
    want = want @ np.asarray(km[1, 0], np.float64).T * np.outer(MASK[1], MASK[1])
    np.testing.assert_allclose(jax.jit(dense_probs)(plan), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(capacity_buckets=(0.25, 0.1)), "capacity_buckets"),
        (dict(capacity_buckets=(0.0, 0.5)), "capacity_buckets"),
        (dict(capacity_buckets=(0.5, 1.5)), "capacity_buckets"),
        (dict(num_clusters=0), "num_clusters"),
        (dict(delta=-0.1), "delta"),
        (dict(edge_law="gumbel"), "edge_law"),
        (dict(impl="fast"), "impl"),
        (dict(impl="dense", max_dense_elements=10), "max_dense_elements"),
        (dict(ste="straight"), "ste"),
        (dict(ste="pairs", pair_probes=0), "pair_probes"),
        (dict(impl="streamed", stream_rows=-1), "stream_rows"),
        (dict(impl="streamed", stream_rows=8, stream_slots=4), "stream_slots"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    mod = _module(**kwargs)
    with pytest.raises(ValueError, match=field):
        mod.init({"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}, _x(), MASK)


def test_missing_sample_rng_is_explained():
    mod = _module()
    with pytest.raises(ValueError, match="sample"):
        mod.init({"params": jax.random.PRNGKey(0)}, _x(), MASK)


def _core_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    h, kc, d = 2, 3, 4
    qm = jnp.asarray(rng.random((B, h, L, kc)) * 0.5, jnp.float32)
    km = jnp.asarray(rng.random((B, h, L, kc)) * 0.5, jnp.float32)
    blk = jnp.asarray(rng.random((h, kc, kc)) / kc, jnp.float32)
    q, k, v, g = (jnp.asarray(rng.normal(size=(B, h, L, d)), jnp.float32) for _ in range(4))
    wd = jnp.asarray(rng.normal(size=(B, h)), jnp.float32)  # weight of each head's density
    return q, k, v, qm, blk, km, g, wd


@pytest.fixture
def fresh_core_traces():
    """The core's jitted body traced afresh in this test and after it. ``jax.jit`` keeps
    its traces by static options, so a trace made before a module function was
    monkeypatched (heads per step) would be reused here, and one made with the patch
    would be reused by later calls with the same options."""
    import sbm_jax.attention.sbm_core as sbm_core

    sbm_core._sbm_attention_core.clear_cache()
    yield
    sbm_core._sbm_attention_core.clear_cache()


@pytest.mark.parametrize(
    "law, kernel, per_step, impl, ste, forced",
    [
        ("bernoulli", "rows", 1, "sparse", "paper", None),
        # vmap over heads (the accelerator path); the STE's vmap is also checked in
        # tests/test_fastrg.py, so this compile-heavy case runs with the slow tests.
        pytest.param("poisson", "segment", None, "sparse", "paper", None, marks=pytest.mark.slow),
        ("bernoulli", "segment", None, "dense", "paper", None),
        ("poisson", "rows", 1, "dense", "paper", (True, 0)),
        # The released code's estimator (issue 15) on every path.
        ("bernoulli", "rows", 1, "sparse", "reference", None),
        pytest.param(
            "bernoulli", "segment", None, "sparse", "reference", (True, 0), marks=pytest.mark.slow
        ),
        pytest.param(
            "bernoulli", "rows", None, "sparse", "reference", (False, 4), marks=pytest.mark.slow
        ),
        ("bernoulli", "rows", 1, "dense", "reference", None),
        ("bernoulli", "rows", None, "dense", "reference", (False, 4)),
    ],
)
def test_core_gradients_match_dense_reference_per_head(
    monkeypatch, fresh_core_traces, law, kernel, per_step, impl, ste, forced
):
    # The whole core (plan, fastRG, STE of p via SpMMs, kernel, density) under grad, with
    # B*H = 4 graphs: every head's gradient must be its own (no sum over heads), heads
    # processed all at once (vmap) or one at a time (lax.map), the sparse path saving
    # only the edge keys for its backward pass. The reference estimator's cases zero two
    # query rows' memberships with delta = 0 (empty rows) and scale the cotangents up so
    # that the clip to [-1, 1] is active on many edges.
    import sbm_jax.attention.sbm_core as sbm_core  # the module whose core reads it

    monkeypatch.setattr(sbm_core, "sparse_heads_per_step", lambda backend=None: per_step)
    q, k, v, qm, blk, km, g, wd = _core_case()
    delta = 0.05
    if ste == "reference":
        qm = qm.at[:, :, jnp.array([2, 9])].set(0.0)
        delta, g, wd = 0.0, 10.0 * g, 40.0 * wd
    rng, buckets = jax.random.PRNGKey(3), (0.5,)
    cap = bucket_capacities(buckets, L, L)[0]
    self_loops, window = forced if forced is not None else (False, 0)

    def core_loss(q, k, v, qm, blk, km):
        out, st = sbm_attention_core(
            rng,
            q,
            k,
            v,
            qm,
            blk,
            km,
            MASK,
            delta=delta,
            law=law,
            capacity_buckets=buckets,
            impl=impl,
            kernel=kernel,
            self_loops=self_loops,
            window=window,
            max_dense_elements=2**31 if impl == "dense" else 1,
            ste=ste,
        )
        return jnp.sum(out * g) + jnp.sum(st["density"] * wd), (st, out)

    args = (q, k, v, qm, blk, km)
    (val, (st, out)), grads = jax.jit(
        jax.value_and_grad(core_loss, argnums=tuple(range(6)), has_aux=True)
    )(*args)
    ref_loss, masks = same_graphs_dense_loss(
        rng,
        *args,
        g,
        wd,
        law=law,
        delta=delta,
        capacity=cap,
        mask=MASK,
        dense=impl == "dense",
        ste=ste,
        forced=forced,
    )
    assert int(st["path"]) == (1 if impl == "dense" else 0)
    assert not np.asarray(st["overflow"]).any()
    np.testing.assert_array_equal(st["edges"], masks.sum((2, 3)))  # the same graphs
    empty = ~masks.any(-1)  # [B, H, L]: padded rows, and the zeroed rows without forced edges
    assert np.all(np.asarray(out)[empty] == 0.0), "rows without an edge output exactly 0"
    if ste == "reference" and forced is None:
        assert empty[:, :, [2, 9]].all() and empty.sum() > 2 * 4 * 2
    ref_val, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=tuple(range(6))))(*args)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for name, a, b in zip(
        ("q", "k", "v", "q_memb", "block", "k_memb"), grads, ref_grads, strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_backward_pass_does_not_rerun_fastrg():
    # With the keys kept as a named residual, the training step contains fastRG's sorts
    # (its deduplication: one per sparse bucket and prefix size) once, as the forward
    # pass alone does, not twice (forward + recomputation).
    q, k, v, qm, blk, km, g, wd = _core_case()
    buckets = (1 / 8, 1 / 2)

    def loss(q, qm):
        out, st = sbm_attention_core(
            jax.random.PRNGKey(0),
            q,
            k,
            v,
            qm,
            blk,
            km,
            MASK,
            delta=0.05,
            capacity_buckets=buckets,
            impl="sparse",
            kernel="rows",
            max_dense_elements=1,
        )
        return jnp.sum(out * g) + jnp.sum(st["density"])

    steps = sampler_options(sparse_heads_per_step())["prefix_steps"]
    sorts = sum(len(prefix_sizes(c, steps)) for c in bucket_capacities(buckets, L, L))
    step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, qm).as_text()
    forward = jax.jit(loss).lower(q, qm).as_text()
    assert forward.count("stablehlo.sort") == sorts
    assert step.count("stablehlo.sort") == sorts


def _projections(params, x):
    """The layer's q, k, v ``[B, H, L, hd]`` and memberships, block, recomputed from its
    parameters (eqs. 5-7), as :func:`_memberships` does."""
    p = params
    proj = {
        name: jnp.einsum("bld,dhe->bhle", x, p[name]["kernel"]) + p[name]["bias"][None, :, None, :]
        for name in ("query", "key", "value")
    }
    qm, s, km = _memberships(None, params, x)
    return proj["query"], proj["key"], proj["value"], qm, s, km


# suite time (~15 s each): both paths run with -m slow; the default run keeps
# test_core_gradients_match_dense_reference_per_head's "reference" cases.
@pytest.mark.parametrize(
    "impl", [pytest.param(i, marks=pytest.mark.slow) for i in ("dense", "sparse")]
)
def test_layer_reference_estimator_matches_the_released_code_per_parameter(monkeypatch, impl):
    # SBMAttention(ste="reference") against the released code written out in this file
    # (_reference_attention: softmax over real keys, times the mask, L1-renormalised,
    # hardtanh backward, density inside it), composed with the layer's projections:
    # forward and every parameter's gradient, with padding (example 1's padded rows have
    # no edge). Real rows without an edge are covered by the core test above.
    import sbm_jax.attention.sbm as sbm_mod

    seen = {}
    core = sbm_mod.sbm_attention_core

    def spy(rng, *args, **kwargs):  # the layer's sample key, to rebuild its graphs
        # Read at run time: the layer's body is traced under jax.checkpoint, so the key
        # is a tracer here.
        jax.debug.callback(lambda r: seen.__setitem__("rng", np.asarray(r)), rng)
        return core(rng, *args, **kwargs)

    monkeypatch.setattr(sbm_mod, "sbm_attention_core", spy)
    mod = _module(impl=impl, ste="reference", delta=0.0)
    x = _x(6)
    params = _init(mod, x)
    big = jax.random.normal(jax.random.PRNGKey(11), (B, L, D)) * 8.0  # clip active
    wd = 50.0

    def loss(params):
        y, st = mod.apply(
            {"params": params},
            x,
            MASK,
            deterministic=False,
            rngs={"sample": jax.random.PRNGKey(12)},
            mutable=[STATS_COLLECTION],
        )
        st = st[STATS_COLLECTION]
        return jnp.sum(y * big) + wd * jnp.mean(st["density"][0]), (y, st)

    (val, (y, st)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    assert int(st["path"][0]) == (1 if impl == "dense" else 0)
    q, k, v, qm, s, km = _projections(params, x)
    ref_loss, masks = same_graphs_dense_loss(
        jnp.asarray(seen["rng"]),
        q,
        k,
        v,
        qm,
        s,
        km,
        None,
        None,
        law="bernoulli",
        delta=0.0,
        capacity=bucket_capacities((0.5,), L, L)[0],
        mask=MASK,
        dense=impl == "dense",
        ste="reference",
    )
    np.testing.assert_array_equal(st["edges"][0], masks.sum((2, 3)))

    def ref(params):
        q, k, v, qm, s, km = _projections(params, x)
        out, density = ref_loss.heads_fn(q, k, v, qm, s, km)
        y = jnp.einsum("bhld,hdo->blo", out, params["out"]["kernel"]) + params["out"]["bias"]
        return jnp.sum(y * big) + wd * jnp.mean(density), y

    (ref_val, ref_y), ref_grads = jax.value_and_grad(ref, has_aux=True)(params)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(grads):
        b = ref_grads
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=str(path))
    for name in ("clusters", "mlp_w1", "mlp_w2", "query", "key", "value"):
        assert any(np.abs(np.asarray(t)).sum() > 0 for t in jax.tree.leaves(grads[name])), name


def test_no_path_fits_is_an_error_before_compilation_with_the_sizes():
    from sbm_jax.attention.sbm import SBMOptions, plan_paths

    # Module: neither a bucket (max_edge_slots) nor the dense path (max_dense_elements).
    mod = _module(max_dense_elements=10, max_edge_slots=100)
    need_slots = 2 * 2 * bucket_capacities((0.5,), L, L)[0]  # batch * heads * capacity
    with pytest.raises(
        ValueError, match=rf"{need_slots} slots, over max_edge_slots=100.*{4 * L * L}"
    ):
        mod.init({"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}, _x(), MASK)

    # A length whose n*m overflows the int32 edge keys, with the dense path ruled out.
    with pytest.raises(ValueError, match="length=50000"):
        plan_paths(
            SBMOptions(capacity_buckets=(0.01,), max_dense_elements=0),
            batch=1,
            heads=1,
            length=50_000,
        )
    # With the dense path allowed the same length runs dense (streamed), no bucket built.
    big = dict(batch=1, heads=1, length=50_000)
    opts = SBMOptions(capacity_buckets=(0.01,), max_dense_elements=2**40)
    assert plan_paths(opts, **big) == ((), True)
    # max_edge_slots drops the buckets that do not fit, the largest first.
    caps, dense = plan_paths(
        SBMOptions(capacity_buckets=(1 / 64, 1 / 16, 1 / 4), impl="sparse"),
        batch=1,
        heads=2,
        length=32768,
    )
    assert caps == (32768**2 // 64,) and dense


def test_default_budgets_keep_the_dense_path_for_paper_presets():
    # LRA Text at paper scale traces 128 x 2 heads x 3072^2 pairs (2.4e9). The dense path
    # is streamed (O(n d) memory per graph), so the module's default must not rule it out:
    # with only the 1/64 bucket under max_edge_slots, a graph at its initial ~25% density
    # would otherwise lose ~95% of its draws.
    from sbm_jax.attention.sbm import SBMOptions, plan_paths

    defaults = SBMAttention(num_heads=2, head_dim=32)
    text = dict(batch=128, heads=2, length=3072)
    limits = dict(
        max_dense_elements=defaults.max_dense_elements, max_edge_slots=defaults.max_edge_slots
    )
    assert 128 * 2 * 3072**2 > 2**31  # above the old default
    options = SBMOptions(capacity_buckets=defaults.capacity_buckets, impl="sparse", **limits)
    caps, dense = plan_paths(options, **text)
    assert dense and caps == (3072**2 // 64,)  # the larger buckets are over max_edge_slots


def test_the_cost_model_counts_a_windows_forced_slots():
    # GLUE's window 64 at n=512 adds 65 forced slots per row to every sparse branch
    # (33,280 against the 1/64 bucket's 4,096); at 7.6 dense pairs per slot that branch
    # costs more than the dense path's 512^2 pairs, so "auto" must leave it out.
    from sbm_jax.attention.sbm import SBMOptions, plan_paths

    shapes = dict(batch=2, heads=2, length=512)
    options = SBMOptions(capacity_buckets=(1 / 64,), edge_cost=7.6)
    assert plan_paths(options, **shapes) == ((512 * 512 // 64,), True)  # no window: sparse pays
    assert (512 * 512 // 64 + 65 * 512) * 7.6 > 512 * 512
    with_window = SBMOptions(capacity_buckets=(1 / 64,), edge_cost=7.6, window=64)
    assert with_window.forced_per_row(512) == 65
    assert plan_paths(with_window, **shapes) == ((), True)


def test_a_window_wider_than_the_sequence_forces_every_pair_once():
    # A window of 2**18 on n = 12 asked for 2**18 + 1 forced slots per row; the forced
    # edges are every real pair either way, so it must cost what a full window costs.
    n = 12
    q_mask = jnp.arange(n) < 9
    wide = forced_edge_keys(q_mask, q_mask, self_loops=False, window=2**18)
    full = forced_edge_keys(q_mask, q_mask, self_loops=False, window=2 * n)
    assert wide.shape == full.shape == (n * (2 * (n - 1) + 1),)
    np.testing.assert_array_equal(np.sort(wide), np.sort(full))
    real = np.flatnonzero(np.outer(q_mask, q_mask).reshape(-1))
    np.testing.assert_array_equal(np.unique(wide[wide < n * n]), real)


def test_capacity_buckets_of_the_wrong_type_name_the_field():
    for buckets in ("(0.1,nan)", (0.1, "x")):
        mod = _module(capacity_buckets=buckets)
        with pytest.raises(ValueError, match="capacity_buckets must be a tuple of numbers|numbers"):
            mod.validate()


def test_overflow_is_sown_for_the_trainer_when_the_dense_path_is_ruled_out():
    # The trainer reads variables["attention_stats"]["overflow"] ([batch, heads] bool per
    # call). With the dense path ruled out (max_dense_elements=0), one run with a bucket
    # of n*m slots (poisson law: no overflow possible below n*m draws, and the expected
    # draws are ~density * n*m) counts each graph's distinct edges, a lower bound on its
    # draws; the same key (same draws) with a bucket below that bound must flag every
    # graph and keep at most the bucket's capacity of edges.
    x = _x()
    base = _module(max_dense_elements=0, edge_law="poisson")
    params = _init(base, x)
    key = jax.random.PRNGKey(3)
    _, mut = _apply(base.clone(capacity_buckets=(1.0,)), params, x, key)
    assert not np.asarray(mut[STATS_COLLECTION]["overflow"][0]).any()
    edges_all = np.asarray(mut[STATS_COLLECTION]["edges"][0])
    tiny = base.clone(capacity_buckets=(1 / 256,))
    cap = bucket_capacities((1 / 256,), L, L)[0]
    assert edges_all.min() > cap, (edges_all, cap)  # the test needs draws above the bucket
    _, mut = _apply(tiny, params, x, key)
    (overflow,) = mut[STATS_COLLECTION]["overflow"]
    (edges,) = mut[STATS_COLLECTION]["edges"]
    assert overflow.shape == (B, 2) and overflow.dtype == jnp.bool_
    assert int(np.asarray(overflow).sum()) == B * 2  # the count the trainer sums
    assert np.asarray(edges).max() <= cap  # edges beyond the bucket were lost, and flagged


def _numpy_sbm(params, x, mask, *, shared_mlp):
    """Y, S, Z and p = Y S Z^T of every (example, head), in float64 numpy from the
    parameter arrays and the inputs (eqs. 5-8); padded rows of Y and Z zeroed."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    real = np.asarray(mask, np.float64)

    def sigmoid(t):
        return 1.0 / (1.0 + np.exp(-t))

    def memberships(name):
        t = np.einsum("bld,dhe->blhe", x, p[name]["kernel"]) + p[name]["bias"]
        eq = "blhd,de->blhe" if shared_mlp else "blhd,hde->blhe"
        h = np.maximum(np.einsum(eq, t, p["mlp_w1"]) + p["mlp_b1"], 0.0)
        e = np.einsum(eq, h, p["mlp_w2"]) + p["mlp_b2"]
        return sigmoid(np.einsum("blhd,hkd->bhlk", e, p["clusters"])) * real[:, None, :, None]

    c = p["clusters"]
    heads, k = c.shape[:2]
    logits = np.einsum("hkd,hjd->hkj", c, c).reshape(heads, k * k)
    s = np.exp(logits - logits.max(-1, keepdims=True))
    s = (s / s.sum(-1, keepdims=True)).reshape(heads, k, k)
    y, z = memberships("query"), memberships("key")
    prob = np.einsum("bhik,hkl,bhjl->bhij", y, s, z)
    return y, s, z, prob


def _numpy_token_densities(prob, mask):
    real = np.asarray(mask)
    n_real = real.sum(1).astype(np.float64)[:, None, None]
    query = (prob * real[:, None, None, :]).sum(-1) / n_real  # mean_j p_ij, real keys
    key = (prob * real[:, None, :, None]).sum(-2) / n_real  # mean_i p_ij, real queries
    return query, key


@pytest.mark.parametrize(("impl", "path"), [("sparse", 0), ("dense", 1)])
def test_sown_token_densities_match_numpy_on_every_path(impl, path):
    """query_density and key_density, sown every call, equal a float64 numpy computation
    from the parameters on the sparse and the dense path, under jit (training mode:
    delta is left out); padded positions are 0; the trainer's aggregation is unchanged."""
    from sbm_jax.attention.sbm import MAPS_COLLECTION
    from sbm_jax.training import collect_attention_stats

    mod = _module(impl=impl)  # the configurations the tests above compile already
    x = _x()
    params = _init(mod, x)
    _, state = _apply(mod, params, x, jax.random.PRNGKey(3))
    st = state[STATS_COLLECTION]
    assert int(st["path"][0]) == path  # 1 = len(capacity_buckets): the dense path
    assert MAPS_COLLECTION not in state  # not requested
    want_query, want_key = _numpy_token_densities(
        _numpy_sbm(params, x, MASK, shared_mlp=False)[3], MASK
    )
    (query,), (key,) = st["query_density"], st["key_density"]
    assert query.shape == key.shape == (B, 2, L)
    np.testing.assert_allclose(np.asarray(query), want_query, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(key), want_key, rtol=1e-5, atol=1e-7)
    padded = ~np.asarray(MASK)[:, None, :].repeat(2, 1)
    assert np.all(np.asarray(query)[padded] == 0) and np.all(np.asarray(key)[padded] == 0)

    # The trainer reads density/edges/overflow by name; the new entries change nothing.
    stats = collect_attention_stats(state)
    assert set(stats) == {
        "density",
        "density_per_head",
        "edges",
        "edges_per_head",
        "overflow",
        "overflow_per_layer",
    }
    assert stats["density_per_head"][""].shape == (2,)
    np.testing.assert_allclose(stats["density"], np.mean(st["density"][0]), rtol=1e-6)


def test_memberships_are_sown_on_request_only():
    """With attention_maps mutable, Y, Z (padded rows 0) and S equal a float64 numpy
    computation from the parameters (shared MLP, evaluation, under jit); init sows
    nothing there (and a plain apply neither: see the test above)."""
    from sbm_jax.attention.sbm import MAPS_COLLECTION

    mod = _module(impl="dense", shared_mlp=True)
    x = _x(3)
    rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}
    variables = jax.jit(mod.init)(rngs, x, MASK)
    assert MAPS_COLLECTION not in variables
    params = nn.unbox(variables["params"])
    run = jax.jit(
        lambda params, x, key: mod.apply(
            {"params": params},
            x,
            MASK,
            deterministic=True,
            rngs={"sample": key},
            mutable=[STATS_COLLECTION, MAPS_COLLECTION],
        )
    )
    _, state = run(params, x, jax.random.PRNGKey(7))
    maps = state[MAPS_COLLECTION]
    assert maps["q_memberships"][0].shape == (B, 2, L, 6) and maps["block"][0].shape == (2, 6, 6)
    y, s, z, prob = _numpy_sbm(params, x, MASK, shared_mlp=True)
    np.testing.assert_allclose(np.asarray(maps["q_memberships"][0]), y, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(maps["k_memberships"][0]), z, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(maps["block"][0]), s, rtol=1e-5, atol=1e-9)
    want_query, want_key = _numpy_token_densities(prob, MASK)
    st = state[STATS_COLLECTION]
    np.testing.assert_allclose(np.asarray(st["query_density"][0]), want_query, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(st["key_density"][0]), want_key, rtol=1e-5)


# suite time (~20 s): the sparse path runs with -m slow; tests/test_pairs_estimator.py
# checks the sparse path's pairs kernel against numpy in the default run.
@pytest.mark.parametrize("impl", ["dense", pytest.param("sparse", marks=pytest.mark.slow)])
def test_pairs_estimator_gives_the_density_its_exact_gradient(impl):
    # Under ste="pairs" the edge count's cotangent reaches every real pair, sampled or
    # not, so the gradient of the sampled density is the gradient of its expectation:
    # mean over real pairs of p + delta (Bernoulli law, p + delta < 1 here), written
    # here from the parameters (eqs. 5-7). Eq. 9 sends it to the sampled edges only.
    mod = _module(impl=impl, ste="pairs", delta=0.0)
    x = _x(8)
    params = _init(mod, x)
    real = np.asarray(MASK, np.float64)
    pairs = real[:, :, None] * real[:, None, :]  # [B, L, L]

    def density(params, module):
        _, st = module.apply(
            {"params": params},
            x,
            MASK,
            rngs={"sample": jax.random.PRNGKey(3)},
            mutable=[STATS_COLLECTION],
        )
        return jnp.mean(st[STATS_COLLECTION]["density"][0])

    def expected(params):
        qm, s, km = _memberships(mod, params, x)
        p = jnp.einsum("bhik,hkl,bhjl->bhij", qm, s, km)
        per_graph = jnp.sum(p * pairs[:, None], axis=(2, 3)) / pairs.sum((1, 2))[:, None]
        return jnp.mean(per_graph)

    _, st = _apply(mod, params, x, jax.random.PRNGKey(3))
    assert int(st[STATS_COLLECTION]["path"][0]) == (0 if impl == "sparse" else 1)

    def grad_of_density(module):  # jitted: one program instead of op-by-op compiles
        return jax.jit(jax.grad(lambda p: density(p, module)))(params)

    got = grad_of_density(mod)
    want = jax.jit(jax.grad(expected))(params)
    eq9 = grad_of_density(_module(impl=impl, ste="paper", delta=0.0))
    for name in ("clusters", "mlp_w1", "mlp_b2", "query"):
        for a, b, c in zip(
            jax.tree.leaves(got[name]),
            jax.tree.leaves(want[name]),
            jax.tree.leaves(eq9[name]),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7, err_msg=name)
            if name == "clusters":
                assert not np.allclose(c, b, rtol=0.05), "eq. 9 should not give the same"


def test_sbm_fields_of_the_wrong_type_or_range_are_named():
    """delta is a probability; window and the integer fields take NumPy integers but not
    floats or strings; the message names the field (a string delta used to fail in a
    comparison inside validate)."""
    import numpy as np
    import pytest

    from sbm_jax import SBMAttention

    base = dict(num_heads=2, head_dim=4, num_clusters=4)
    for field, value, message in (
        ("delta", "0.1", r"delta must lie in \[0, 1\] \(a probability\), got '0.1'"),
        ("delta", 2.0, r"delta must lie in \[0, 1\] \(a probability\), got 2.0"),
        ("window", 2.5, "window must be an int >= 0, got 2.5"),
        ("num_clusters", 4.0, "num_clusters must be an int >= 1, got 4.0"),
        ("out_dim", 0, "out_dim must be an int >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            SBMAttention(**(base | {field: value})).validate()
    SBMAttention(**(base | {"num_clusters": np.int64(4), "window": np.int32(2)})).validate()


@pytest.mark.parametrize(
    "law, ste, forced, slots",
    [
        ("bernoulli", "paper", None, 12),
        ("poisson", "reference", (False, 4), 5),
        ("bernoulli", "paper", (True, 0), 12),
    ],
)
def test_streamed_core_matches_dense_reference_on_its_graphs(law, ste, forced, slots):
    # impl="streamed": blocks of 4 query rows, one small buffer per block, so some
    # blocks draw sparse and the others (more draws than slots) run dense alone; the
    # backward pass draws every block again. Output, density and every gradient against
    # the dense reference on the graphs rebuilt block by block.
    from sbm_jax.kernels.streamed import StreamConfig

    q, k, v, qm, blk, km, g, wd = _core_case()
    delta = 0.05
    if ste == "reference":
        qm = qm.at[:, :, jnp.array([2, 9])].set(0.0)
        delta, g, wd = 0.0, 10.0 * g, 40.0 * wd
    rng = jax.random.PRNGKey(3)
    self_loops, window = forced if forced is not None else (False, 0)
    half = window // 2 if window > 0 else (0 if self_loops else -1)
    opts = dict(stream_rows=4, stream_slots=slots, edge_cost=1e-3)

    def core_loss(q, k, v, qm, blk, km):
        out, st = sbm_attention_core(
            rng, q, k, v, qm, blk, km, MASK, delta=delta, law=law, impl="streamed",
            self_loops=self_loops, window=window, ste=ste, **opts,
        )  # fmt: skip
        return jnp.sum(out * g) + jnp.sum(st["density"] * wd), (st, out)

    args = (q, k, v, qm, blk, km)
    (val, (st, out)), grads = jax.jit(
        jax.value_and_grad(core_loss, argnums=tuple(range(6)), has_aux=True)
    )(*args)
    cfg = StreamConfig(
        block_rows=4, capacities=(slots,), dense=True, law=law, ste=ste, forced_half=half,
        dropout_rate=0.0, pair_probes=16, thin_budget=THIN_BUDGET,
    )  # fmt: skip
    masks, choices = streamed_masks(rng, qm, blk, km, MASK, law=law, delta=delta, cfg=cfg)
    assert (choices == 0).any() and (choices == 1).any(), choices  # both kinds of block
    assert int(st["path"]) == 3  # len(capacity_buckets), the defaults: some block ran dense
    assert not np.asarray(st["overflow"]).any()
    np.testing.assert_array_equal(st["edges"], masks.sum((2, 3)))  # the same graphs
    empty = ~masks.any(-1)
    assert np.all(np.asarray(out)[empty] == 0.0), "rows without an edge output exactly 0"
    ref_loss = dense_loss_on_masks(masks, g, wd, mask=MASK, ste=ste)
    ref_val, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=tuple(range(6))))(*args)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for name, a, b in zip(
        ("q", "k", "v", "q_memb", "block", "k_memb"), grads, ref_grads, strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_block_buffer_too_small_for_a_draw_per_row_is_refused_before_compilation():
    # With the automatic block rows the check needs the length: the module's paths_for
    # (what the trainer's config check runs for every batch) refuses it, naming the field.
    mod = SBMAttention(num_heads=2, head_dim=4, impl="streamed", stream_slots=3)
    mod.validate()  # no length yet: fine
    with pytest.raises(ValueError, match="stream_slots=3 is too small"):
        mod.paths_for(2, 64)
    assert mod.clone(stream_slots=64).paths_for(2, 64)[1]
