"""The SBM layer's correctness at GPU/TPU scale, with the backend's own head mapping.

Marked ``accelerator`` (see tests/conftest.py): skipped on a CPU unless
``SBM_ACCELERATOR_TESTS=1``. On a GPU/TPU the layer maps (example, head) graphs with one
``vmap`` (the sampler's thinning then computes ``p_e`` on every slot, and the kernels'
loops carry batched trip counts), which the CPU's default run checks only at toy sizes.
The command a GPU/TPU user runs is in docs/benchmarks.md ("On a GPU or TPU").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention.sbm import bucket_capacities, sbm_attention_core
from sbm_jax.kernels.dense import streamed_mask
from tests.sbm_testing import same_graphs_dense_loss

pytestmark = pytest.mark.accelerator


@pytest.fixture(autouse=True)
def _float32_matmuls():
    # On an NVIDIA GPU, JAX's default precision runs float32 matrix products in TF32
    # (10-bit mantissa): on an H100 the layer and the dense reference then differed by
    # 5e-4 relative in the loss (2026-11-27), past these tests' float32 tolerances. The
    # tests check that the two compute the same function, so both run in full float32.
    with jax.default_matmul_precision("highest"):
        yield


B, H, L, KC, D = 2, 2, 256, 8, 16
MASK = jnp.arange(L)[None, :] < jnp.array([[L], [L - 37]])


def _case(seed=0):
    rng = np.random.default_rng(seed)
    qm = jnp.asarray(rng.random((B, H, L, KC)) * 0.3, jnp.float32)
    km = jnp.asarray(rng.random((B, H, L, KC)) * 0.3, jnp.float32)
    blk = jnp.asarray(rng.random((H, KC, KC)) / KC, jnp.float32)
    q, k, v, g = (jnp.asarray(rng.normal(size=(B, H, L, D)), jnp.float32) for _ in range(4))
    wd = jnp.asarray(rng.normal(size=(B, H)), jnp.float32) * 20.0
    return q, k, v, qm, blk, km, 5.0 * g, wd


def _needs_gpu(kernel):
    if kernel == "triton" and jax.default_backend() != "gpu":
        pytest.skip("kernel='triton' runs on an NVIDIA GPU only")


@pytest.mark.parametrize("ste", ["paper", "reference"])
@pytest.mark.parametrize(
    "impl, kernel",
    [("sparse", "rows"), ("sparse", "segment"), ("sparse", "triton"), ("dense", "rows")],
)
def test_core_matches_the_dense_reference_per_graph(ste, impl, kernel):
    _needs_gpu(kernel)
    q, k, v, qm, blk, km, g, wd = _case()
    rng, delta, buckets = jax.random.PRNGKey(4), 0.02, (0.25,)

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
            capacity_buckets=buckets,
            impl=impl,
            kernel=kernel,
            window=6,
            max_dense_elements=2**31 if impl == "dense" else 1,
            ste=ste,
        )
        return jnp.sum(out * g) + jnp.sum(st["density"] * wd), st

    args = (q, k, v, qm, blk, km)
    (val, st), grads = jax.jit(jax.value_and_grad(core_loss, argnums=range(6), has_aux=True))(*args)
    ref_loss, masks = same_graphs_dense_loss(
        rng,
        *args,
        g,
        wd,
        mask=MASK,
        law="bernoulli",
        delta=delta,
        capacity=bucket_capacities(buckets, L, L)[0],
        dense=impl == "dense",
        ste=ste,
        forced=(False, 6),
    )
    assert int(st["path"]) == (1 if impl == "dense" else 0)
    np.testing.assert_array_equal(st["edges"], masks.sum((2, 3)))
    ref_val, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=range(6)))(*args)
    np.testing.assert_allclose(val, ref_val, rtol=1e-4)
    for name, a, b in zip(
        ("q", "k", "v", "q_memb", "block", "k_memb"), grads, ref_grads, strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4, err_msg=name)


def test_streamed_dense_mask_density_at_scale():
    # n = 2048 (64 blocks): the mean of the mask over many draws against p + delta.
    n, trials, delta = 2048, 16, 0.01
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    ys = jax.random.uniform(ks[0], (n, KC)) * 0.05
    zk = jax.random.uniform(ks[1], (n, KC))
    real = jnp.arange(n) < n - 100
    want = np.minimum(np.asarray(ys @ zk.T) + delta, 1.0) * np.outer(real, real)
    masks = jax.vmap(lambda kk: streamed_mask(kk, ys, zk, real, real, delta))(
        jax.random.split(ks[2], trials)
    )
    freq = np.asarray(jnp.mean(masks, axis=0, dtype=jnp.float32))
    assert not freq[~np.outer(real, real)].any()
    # Row sums: each is a sum of ~n independent Bernoulli means over `trials` draws.
    var = np.sum(want * (1 - want), axis=1) / trials
    z = (freq.sum(1) - want.sum(1)) / np.sqrt(np.maximum(var, 1e-12))
    assert np.all(np.abs(z[np.asarray(real)]) < 6.0)
    assert abs(np.mean(z[np.asarray(real)])) < 6.0 / np.sqrt(real.sum())


def test_plan_cdfs_at_scale_with_the_backends_method():
    # fastRG's plans as the layer builds them (vmap over 4 graphs), n = m = 4096 with
    # padding at the end and inside, and weight_cdf's method for this backend (loop-free
    # on GPU/TPU, sequential scans on CPU): a padded key's step in every cluster's CDF is
    # exactly 0, every CDF is nondecreasing, and both stay within float32 rounding of
    # float64 prefix sums of the same weights.
    from sbm_jax.fastrg import make_plan

    n, k, graphs = 4096, 128, 4
    rng = np.random.default_rng(5)
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731
    y = sig(rng.normal(-2, 1, (graphs, n, k))).astype(np.float32)
    z = sig(rng.normal(-2, 1, (graphs, n, k))).astype(np.float32)
    block = sig(rng.normal(-3, 1, (graphs, k, k))).astype(np.float32)
    mask = np.arange(n) < n - 700
    mask[rng.random(n) < 0.1] = False
    masks = jnp.asarray(np.broadcast_to(mask, (graphs, n)))
    plans = jax.jit(jax.vmap(lambda a, b, c, qm, km: make_plan(a, b, c, q_mask=qm, k_mask=km)))(
        y, block, z, masks, masks
    )
    zcdf = np.asarray(plans.zcdf)  # [graphs, K, m]
    steps = np.diff(zcdf, axis=2, prepend=0.0)
    assert np.all(steps >= 0)
    assert np.all(steps[:, :, ~mask] == 0)
    want = np.cumsum((z * mask[None, :, None]).astype(np.float64), axis=1)  # [graphs, m, k]
    want = np.swapaxes(want, 1, 2)
    scale = want[:, :, -1:]
    assert np.all(np.abs(zcdf[:, :k] - want) <= 1e-6 * scale)
    row_cdf = np.asarray(plans.row_cdf)  # [graphs, n, K]
    assert np.all(np.diff(row_cdf, axis=2) >= 0)
    assert np.all(row_cdf[:, ~mask] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_kernel_matches_segment_with_hardware_atomics(dtype):
    # The GPU's atomic_add in the triton kernel's backward (interpret mode on CPU uses a
    # scatter-add instead): 64 keys reached by 2048 queries, so every block adds into
    # the same key rows many times; scale, bias and dropout on.
    _needs_gpu("triton")
    from sbm_jax import edge_attention
    from sbm_jax.graph import EdgeList

    n, m, d, per_row = 2048, 64, 32, 24
    rng = np.random.default_rng(3)
    cols = np.sort(np.stack([rng.choice(m, per_row, replace=False) for _ in range(n)]), 1)
    deg = rng.integers(0, per_row + 1, n)  # ragged rows, some empty
    keep = np.arange(per_row)[None, :] < deg[:, None]
    rows = np.repeat(np.arange(n), per_row).reshape(n, per_row)[keep]
    cols = cols[keep]
    e, cap = len(rows), len(rows) + 100
    edges = EdgeList(
        rows=jnp.asarray(np.concatenate([rows, np.full(100, n - 1)]), jnp.int32),
        cols=jnp.asarray(np.concatenate([cols, np.zeros(100)]), jnp.int32),
        valid=jnp.asarray(np.arange(cap) < e),
        probs=jnp.zeros((cap,), jnp.float32),
    )
    q, k, v, g = (jnp.asarray(rng.normal(size=(s, d)), dtype) for s in (n, m, m, n))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, cap), jnp.float32)
    bias = jnp.asarray(rng.normal(size=cap) * 0.3, jnp.float32)
    kw = dict(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(5))

    def loss(impl):
        def f(q, k, v, s, b):
            out = edge_attention(q, k, v, edges, edge_scale=s, edge_bias=b, impl=impl, **kw)
            return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

        return jax.jit(jax.value_and_grad(f, argnums=range(5)))

    val, got = loss("triton")(q, k, v, scale, bias)
    # the reference in float32 on the same (rounded) inputs: the segment implementation
    # in bf16 would scatter-add its dK/dV per edge in bf16
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    ref_val, ref = loss("segment")(*f32, scale, bias)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-4
    np.testing.assert_allclose(val, ref_val, rtol=tol)
    for name, a, b in zip(("q", "k", "v", "scale", "bias"), got, ref, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
