"""sbm_jax._random.uniform is jax.random.uniform, bit for bit (only the lowering differs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax._random import bernoulli, threefry2x32, uniform


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4), (40000,)])
def test_uniform_is_jax_random_uniform(shape):
    jitted = jax.jit(uniform, static_argnums=1)
    keys = (jax.random.key(3), jax.random.PRNGKey(11), jax.random.fold_in(jax.random.key(5), 9))
    for key in keys:
        want = np.asarray(jax.random.uniform(key, shape))
        np.testing.assert_array_equal(np.asarray(uniform(key, shape)), want)
        np.testing.assert_array_equal(np.asarray(jitted(key, shape)), want)


def test_uniform_under_vmap_keeps_each_key():
    keys = jax.random.split(jax.random.key(0), 5)
    got = jax.jit(jax.vmap(lambda k: uniform(k, (6, 2))))(keys)
    want = jnp.stack([jax.random.uniform(k, (6, 2)) for k in keys])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "key, count, want",
    [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 2, (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ],
)
def test_threefry_known_answers(key, count, want):
    # Threefry-2x32, 20 rounds: the known-answer vectors of the Random123 suite.
    k0, k1 = (jnp.uint32(w) for w in key)
    x0, x1 = threefry2x32(k0, k1, *(jnp.full((1,), w, jnp.uint32) for w in count))
    assert (int(x0[0]), int(x1[0])) == want


def test_other_generators_fall_back():
    key = jax.random.key(1, impl="rbg")
    np.testing.assert_array_equal(
        np.asarray(uniform(key, (4, 3))), np.asarray(jax.random.uniform(key, (4, 3)))
    )


def test_bernoulli_is_jax_random_bernoulli():
    key = jax.random.key(7)
    for p in (0.0, 0.1, 0.9, 1.0):
        want = np.asarray(jax.random.bernoulli(key, p, (300,)))
        np.testing.assert_array_equal(np.asarray(bernoulli(key, p, (300,))), want)
