"""Tensor-train (MPO) dense layers against dense numpy references and the paper's counts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.layers import (
    TTDense,
    prime_factors,
    qtt_shapes,
    tt_contract,
    tt_core_shapes,
    tt_cores_of,
    tt_modes,
    tt_num_params,
    tt_ranks,
    tt_to_dense,
)
from tests.attention_testing import tt_dense_by_loops

IN_MODES = (2, 3, 2)
OUT_MODES = (3, 2, 4)
RANKS = (1, 2, 3, 1)


def random_cores(seed: int, in_modes=IN_MODES, out_modes=OUT_MODES, ranks=RANKS):
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((ranks[n], in_modes[n], out_modes[n], ranks[n + 1])).astype(np.float32)
        for n in range(len(in_modes))
    ]


def numpy_dense_from_cores(cores) -> np.ndarray:
    """W[(i1 i2 i3), (j1 j2 j3)] = G1[0,i1,j1,:] G2[:,i2,j2,:] G3[:,i3,j3,0], row-major indices."""
    g1, g2, g3 = (np.asarray(c, np.float64) for c in cores)
    w = np.einsum("aijb,bklc,cmnd->ikmjln", g1, g2, g3)  # a = d = 0 (size 1), summed away
    i_dim = g1.shape[1] * g2.shape[1] * g3.shape[1]
    j_dim = g1.shape[2] * g2.shape[2] * g3.shape[2]
    return w.reshape(i_dim, j_dim)


def test_numpy_references_agree():
    cores = random_cores(0)
    np.testing.assert_allclose(numpy_dense_from_cores(cores), tt_dense_by_loops(cores), 1e-10)


def test_tt_to_dense_matches_definition():
    cores = random_cores(1)
    w = jax.jit(tt_to_dense)([jnp.asarray(c) for c in cores])
    assert w.shape == (12, 24)
    np.testing.assert_allclose(np.asarray(w), tt_dense_by_loops(cores), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_tt_contract_equals_dense_matmul(lead):
    cores = random_cores(2)
    x = np.random.default_rng(3).standard_normal((*lead, 12)).astype(np.float32)
    y = jax.jit(tt_contract)(jnp.asarray(x), [jnp.asarray(c) for c in cores])
    expected = x.astype(np.float64) @ tt_dense_by_loops(cores)
    assert y.shape == (*lead, 24)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-4)


def test_tt_contract_gradients_match_dense():
    cores = [jnp.asarray(c) for c in random_cores(4)]
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 12)), jnp.float32)

    def loss_tt(x, cores):
        return jnp.sum(jnp.sin(tt_contract(x, cores)))

    def loss_dense(x, cores):
        return jnp.sum(jnp.sin(x @ tt_to_dense(cores)))

    gx_tt, gc_tt = jax.jit(jax.grad(loss_tt, argnums=(0, 1)))(x, cores)
    gx_dense, gc_dense = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(x, cores)
    # Closed form for the input gradient: cos(x W) W^T.
    w = tt_dense_by_loops([np.asarray(c) for c in cores])
    xw = np.asarray(x, np.float64) @ w
    np.testing.assert_allclose(np.asarray(gx_tt), np.cos(xw) @ w.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gx_tt), np.asarray(gx_dense), rtol=1e-4, atol=1e-4)
    for a, b in zip(gc_tt, gc_dense, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_ttdense_module_matches_dense_with_bias():
    layer = TTDense(24, rank=RANKS, in_modes=IN_MODES, out_modes=OUT_MODES, use_bias=True)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 12)), jnp.float32)
    params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
    cores = random_cores(7)
    bias = np.random.default_rng(8).standard_normal(24).astype(np.float32)
    params = {f"core_{n}": jnp.asarray(c) for n, c in enumerate(cores)} | {"bias": bias}
    y = jax.jit(layer.apply)({"params": params}, x)
    expected = np.asarray(x, np.float64) @ tt_dense_by_loops(cores) + bias
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-4)
    assert [c.shape for c in tt_cores_of(params)] == tt_core_shapes(IN_MODES, OUT_MODES, RANKS)


def test_ttdense_auto_modes_for_unequal_dims():
    layer = TTDense(8, rank=3, use_bias=False)
    x = jnp.ones((2, 12))
    params = jax.jit(layer.init)(jax.random.key(1), x)["params"]
    cores = tt_cores_of(params)
    assert [c.shape[1] for c in cores] == [2, 2, 3]
    assert [c.shape[2] for c in cores] == [2, 2, 2]
    w = tt_dense_by_loops([np.asarray(c) for c in cores])
    np.testing.assert_allclose(
        np.asarray(jax.jit(layer.apply)({"params": params}, x)),
        np.ones((2, 12)) @ w,
        rtol=1e-4,
        atol=1e-4,
    )


def test_param_count_formula_matches_module():
    layer = TTDense(24, rank=RANKS, in_modes=IN_MODES, out_modes=OUT_MODES, use_bias=False)
    params = jax.jit(layer.init)(jax.random.key(0), jnp.ones((1, 12)))["params"]
    counted = sum(p.size for p in jax.tree.leaves(params))
    # sum_n R_{n-1} I_n J_n R_n = 1*2*3*2 + 2*3*2*3 + 3*2*4*1
    assert counted == tt_num_params(IN_MODES, OUT_MODES, RANKS) == 12 + 36 + 24


@pytest.mark.parametrize("n", range(2, 11))
def test_qtt_param_count_is_16_n_minus_1(n):
    in_modes, out_modes, ranks = qtt_shapes(2**n)
    assert in_modes == out_modes == (2,) * n
    assert ranks == (1,) + (2,) * (n - 1) + (1,)
    # Paper sec. 4.2: sum_n R_{n-1} I_n J_n R_n = 16 (N - 1): the two boundary cores hold
    # 1*2*2*2 = 8 each and the N - 2 inner cores 2*2*2*2 = 16 each.
    assert tt_num_params(in_modes, out_modes, ranks) == 16 * (n - 1)
    shapes = tt_core_shapes(in_modes, out_modes, ranks)
    assert all(math.prod(s) == 16 for s in shapes[1:-1])
    assert math.prod(shapes[0]) == math.prod(shapes[-1]) == 8
    layer = TTDense(2**n, rank=2, use_bias=False)
    params = jax.eval_shape(layer.init, jax.random.key(n), jnp.ones((1, 2**n)))["params"]
    assert sum(math.prod(p.shape) for p in jax.tree.leaves(params)) == 16 * (n - 1)
    assert 16 * (n - 1) <= 4**n  # the dense weight it replaces (equal only at N = 2)


def test_qtt_single_mode_is_dense():
    # N = 1 is outside the formula's range: one 1x2x2x1 core, i.e. a dense 2x2 weight.
    in_modes, out_modes, ranks = qtt_shapes(2)
    assert tt_num_params(in_modes, out_modes, ranks) == 4


def test_default_init_gives_lecun_variance():
    # E[W_ij^2] = (prod of inner ranks) * s^(2N) = 1 / fan_in exactly; check by Monte Carlo.
    layer = TTDense(16, rank=2, use_bias=False)
    x = jnp.ones((1, 16))

    def dense_w(key):
        return tt_to_dense(tt_cores_of(layer.init(key, x)["params"]))

    w = jax.jit(jax.vmap(dense_w))(jax.random.split(jax.random.key(0), 1000))
    second_moment = float(jnp.mean(w**2))
    assert abs(second_moment * 16 - 1.0) < 0.1, second_moment


def test_modes_and_ranks_helpers():
    assert prime_factors(1) == []
    assert prime_factors(360) == [2, 2, 2, 3, 3, 5]
    assert prime_factors(97) == [97]
    assert tt_modes(64, 64) == ((2,) * 6, (2,) * 6)
    assert tt_modes(64, 8) == ((2,) * 6, (2, 2, 2, 1, 1, 1))
    assert tt_modes(6, 7) == ((2, 3), (7, 1))
    assert tt_ranks(3, 4) == (1, 4, 4, 1)
    assert tt_ranks(1, 4) == (1, 1)


def test_errors_name_the_bad_argument():
    with pytest.raises(ValueError, match="in_modes"):
        TTDense(8, in_modes=(2, 2), out_modes=(2, 4)).init(jax.random.key(0), jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="out_modes"):
        TTDense(8, in_modes=(2, 4), out_modes=(2, 2)).init(jax.random.key(0), jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="given together"):
        TTDense(8, in_modes=(2, 4)).init(jax.random.key(0), jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="start and end with 1"):
        tt_ranks(2, (2, 2, 1))
    with pytest.raises(ValueError, match="power of two"):
        qtt_shapes(12)
    with pytest.raises(ValueError, match="last dimension"):
        tt_contract(jnp.ones((2, 5)), [jnp.ones((1, 2, 2, 1)), jnp.ones((1, 2, 2, 1))])
