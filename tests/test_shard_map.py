"""Attention layers inside ``jax.shard_map`` (manual data parallelism, JAX's current API).

Inside ``shard_map`` JAX checks that every loop carry varies over the same mesh axes on
the way in and out; a carry started from a constant broke the SBM layer there (its
sampler, edge kernels, straight-through backward and dense path all loop). Checked:

* on a one-device mesh (the check applies whatever the mesh size), every registered
  mechanism, and the SBM layer on each of its paths, gives the loss and gradients of the
  same step without ``shard_map``;
* on four CPU devices (a subprocess, the slow run), the SBM layer over a batch split four
  ways gives each example what that example gives alone, with the same keys.

The default run keeps the unit tests of ``vary_like`` (the fix itself); the layer cases
compile the SBM layer twice each and run with ``-m slow``.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sbm_jax._varying import vary_like
from sbm_jax.attention import STATS_COLLECTION, available, get_attention
from tests.process_testing import run_and_collect, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = "data"


def _mesh(devices: int = 1) -> jax.sharding.Mesh:
    return jax.make_mesh((devices,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))


def _layer(name: str, **options):
    return get_attention(name)(num_heads=2, head_dim=8, out_dim=16, **options)


def _step(mod):
    """``(params, x) -> (loss, grads)`` of one training-mode forward + backward."""

    def loss(p, x):
        mask = jnp.ones(x.shape[:2], bool)
        rngs = {"sample": jax.random.PRNGKey(3), "dropout": jax.random.PRNGKey(4)}
        out = mod.apply({"params": p}, x, mask, deterministic=False, rngs=rngs)
        return jnp.sum(out**2)

    return jax.value_and_grad(loss)


def _compare_one_device(mod, n: int) -> None:
    x = jax.random.normal(jax.random.PRNGKey(0), (2, n, 16))
    rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
    params = mod.init(rngs, x, jnp.ones((2, n), bool), deterministic=False)["params"]
    step = _step(mod)
    want_loss, want_grads = jax.jit(step)(params, x)

    def sharded(p, xl):
        # The loss is per device; the parameters' gradient comes back summed over the
        # devices already (the transpose of their implicit broadcast is a psum).
        value, grads = step(p, xl)
        return jax.lax.psum(value, DATA), grads

    got_loss, got_grads = jax.jit(
        jax.shard_map(sharded, mesh=_mesh(), in_specs=(P(), P(DATA)), out_specs=(P(), P()))
    )(params, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _sbm_path(mod, n: int) -> int:
    x = jax.random.normal(jax.random.PRNGKey(0), (2, n, 16))
    mask = jnp.ones((2, n), bool)
    rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
    params = mod.init(rngs, x, mask, deterministic=False)["params"]
    _, stats = mod.apply(
        {"params": params},
        x,
        mask,
        deterministic=False,
        rngs={"sample": jax.random.PRNGKey(3), "dropout": jax.random.PRNGKey(4)},
        mutable=[STATS_COLLECTION],
    )
    return int(jax.tree.leaves(stats[STATS_COLLECTION]["path"])[0])


@pytest.mark.parametrize(
    ("options", "dense"),
    [
        # the sparse path: on CPU the fused kernel (kernel="auto"), an FFI call whose
        # results must vary over the mesh axis like its operands
        pytest.param({"impl": "sparse"}, False, id="sparse"),
        pytest.param(
            {"impl": "sparse", "ste": "pairs", "attention_dropout": 0.1},
            False,
            marks=pytest.mark.slow,
            id="sparse-pairs-dropout",
        ),
        # the streamed dense path (its backward's loop carries vary over the mesh axis)
        pytest.param({"impl": "dense"}, True, id="dense"),
    ],
)
def test_sbm_layer_under_shard_map_matches_plain_jit(options, dense):
    # Six clusters and one bucket of half the pairs: the sparse path at initialisation.
    mod = _layer("sbm", num_clusters=6, capacity_buckets=(0.5,), **options)
    n = 256
    # The path the case is meant to cover is the one the layer takes.
    assert (_sbm_path(mod, n) == len(mod.capacity_buckets)) == dense
    _compare_one_device(mod, n)


@pytest.mark.slow
@pytest.mark.parametrize("name", available())
def test_every_mechanism_under_shard_map_matches_plain_jit(name):
    _compare_one_device(_layer(name), 128)


def test_vary_like_is_the_identity_outside_shard_map():
    init = (jnp.zeros(3), {"a": jnp.ones((2, 2), jnp.int32)})
    out = vary_like(init, jnp.arange(4.0))
    assert jax.tree.structure(out) == jax.tree.structure(init)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(init), strict=True):
        assert a is b


def test_vary_like_lets_a_loop_start_from_a_constant_inside_shard_map():
    def summed(x, fix):
        init = jnp.zeros(x.shape[1:])
        init = vary_like(init, x) if fix else init
        return jax.lax.fori_loop(0, x.shape[0], lambda i, acc: acc + x[i], init)[None]

    x = jnp.arange(12.0).reshape(1, 4, 3)
    run = lambda fix: jax.shard_map(  # noqa: E731
        lambda xl: summed(xl[0], fix), mesh=_mesh(), in_specs=P(DATA), out_specs=P(DATA)
    )(x)
    with pytest.raises(TypeError, match="carry"):
        run(False)  # what the layer's loops did before
    np.testing.assert_array_equal(run(True)[0], np.arange(12.0).reshape(4, 3).sum(0))


@pytest.mark.parametrize("method", ["scan", "parallel"])
@pytest.mark.parametrize("length", [129, 1000])  # one sequential pass; blocks
def test_weight_cdf_runs_inside_shard_map(length, method):
    """fastRG's CDFs on CPU are lax.scan loops (one pass, or blocks and their offsets):
    their carries must vary like the weights, or the SBM layer fails to trace under
    shard_map. The accelerators' method too. Reference: float64 prefix sums."""
    from sbm_jax.fastrg import weight_cdf

    w = jax.random.uniform(jax.random.PRNGKey(0), (1, length, 3))
    run = jax.shard_map(
        lambda wl: weight_cdf(wl[0], 0, method)[None],
        mesh=_mesh(),
        in_specs=P(DATA),
        out_specs=P(DATA),
    )
    got = np.asarray(jax.jit(run)(w))[0]
    want = np.cumsum(np.asarray(w[0], np.float64), axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-6)


_FOUR_DEVICES = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from sbm_jax.attention import get_attention

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    mod = get_attention("sbm")(num_heads=2, head_dim=8, out_dim=16, num_clusters=6,
                               capacity_buckets=(0.5,), impl="sparse")
    n = 512
    x = jax.random.normal(jax.random.PRNGKey(0), (4, n, 16))
    g = jax.random.normal(jax.random.PRNGKey(5), (4, n, 16))
    init_rngs = {"params": jax.random.PRNGKey(1), "sample": jax.random.PRNGKey(2)}
    params = mod.init(init_rngs, x[:1], jnp.ones((1, n), bool), deterministic=False)["params"]

    def loss(p, xl, gl):
        mask = jnp.ones(xl.shape[:2], bool)
        out, st = mod.apply({"params": p}, xl, mask, deterministic=False,
                            rngs={"sample": jax.random.PRNGKey(3)}, mutable=["attention_stats"])
        return jnp.sum(out * gl), (out, st["attention_stats"]["path"][0])

    def step(p, xl, gl):
        (value, (out, path)), grads = jax.value_and_grad(loss, has_aux=True)(p, xl, gl)
        # The parameters enter unsharded (P()): their gradient comes back already summed
        # over the devices (the transpose of their implicit broadcast is a psum).
        return jax.lax.psum(value, "data"), grads, out, path[None]

    sharded = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P(), P("data"), P("data"))))
    value, grads, out, paths = sharded(params, x, g)

    # Reference: each example alone (batch 1, the same keys), one device.
    alone = jax.jit(jax.value_and_grad(loss, has_aux=True))
    parts = [alone(params, x[i:i + 1], g[i:i + 1]) for i in range(4)]
    ref_value = sum(float(v) for (v, _), _ in parts)
    ref_out = np.concatenate([np.asarray(o) for (_, (o, _)), _ in parts])
    ref_grads = jax.tree.map(lambda *a: sum(a), *[gr for _, gr in parts])
    grad_err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    grad_scale = max(float(np.max(np.abs(np.asarray(b)))) for b in jax.tree.leaves(ref_grads))
    print("RESULT " + json.dumps({
        "value": float(value), "ref_value": ref_value,
        "out_err": float(np.max(np.abs(np.asarray(out) - ref_out))),
        "out_scale": float(np.max(np.abs(ref_out))),
        "grad_err": grad_err, "grad_scale": grad_scale,
        "paths": np.asarray(paths).tolist(),
        "examples_differ": bool(np.max(np.abs(ref_out[0] - ref_out[1])) > 1e-3),
    }), flush=True)
    """
)


@pytest.mark.slow  # suite time: vary_like's loop test stays
def test_sbm_layer_split_over_four_devices_matches_each_example_alone(tmp_path):
    script = tmp_path / "four_devices.py"
    script.write_text(_FOUR_DEVICES)
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(4),
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    (result,) = run_and_collect([[sys.executable, str(script)]], env, timeout=300)
    assert result["paths"] == [0, 0, 0, 0]  # every device took the sparse bucket
    assert result["examples_differ"]  # four different graphs, not one copied
    np.testing.assert_allclose(result["value"], result["ref_value"], rtol=1e-5)
    assert result["out_err"] <= 1e-5 * max(1.0, result["out_scale"]), json.dumps(result)
    assert result["grad_err"] <= 1e-4 * max(1.0, result["grad_scale"]), json.dumps(result)
