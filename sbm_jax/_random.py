"""``jax.random.uniform``'s exact draws, with Threefry unrolled so that XLA fuses it.

The samplers draw two uniforms per fastRG draw and one per pair on the dense path (from
keys folded with a chunk or block index, so that a backward pass can regenerate a mask):
several million per graph. JAX lowers its Threefry-2x32 hash on CPU as a rolled loop of
five steps over whole arrays; on GPU and TPU it unrolls the 20 rounds. :func:`uniform`
computes the same hash on the same counters, unrolled (plain ``uint32`` arithmetic that
XLA fuses into one pass), so its output is bit for bit ``jax.random.uniform(key,
shape)`` on every backend and under ``vmap``, and on CPU it is faster than the rolled
loop (the measured ratio is in docs/log.md, "Code comments (dated figures)").

It reproduces JAX's default scheme (``jax_threefry_partitionable``, a threefry key):
each 32-bit word is ``hash(key, (0, i))`` folded to one word by xor, ``i`` the flat
index. Any other configuration falls back to ``jax.random.uniform`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: Threefry-2x32's rotation constants (Salmon et al. 2011), by half of each round group.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotl(x: jax.Array, d: int) -> jax.Array:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def threefry2x32(
    k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds on counters ``(x0, x1)`` under key ``(k0, k1)``."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotl(x1, r)
        x0 = x0 + ks[(group + 1) % 3]
        x1 = x1 + ks[(group + 2) % 3] + np.uint32(group + 1)
    return x0, x1


def _threefry_key_words(key: jax.Array) -> jax.Array | None:
    """The key's two ``uint32`` words (``[..., 2]`` for an array of keys), or None when
    it is not a threefry key."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(key)):
            return None
        return jax.random.key_data(key)
    if key.dtype == jnp.uint32 and key.shape[-1:] == (2,):  # raw jax.random.PRNGKeys
        return key
    return None


def windowed_words(keys: jax.Array) -> jax.Array | None:
    """``[..., 2]`` words of ``keys`` for :func:`uniform_window`, or None where a window
    of a draw cannot be computed on its own (not a threefry key, or not JAX's
    partitionable scheme, in which a word depends only on its flat index)."""
    if not jax.config.jax_threefry_partitionable:  # type: ignore[attr-defined]
        return None
    return _threefry_key_words(keys)


def uniform_window(words: jax.Array, counters: jax.Array) -> jax.Array:
    """Entries of :func:`uniform` draws without the rest of them: with ``words [..., 2]``
    of keys (:func:`windowed_words`) and ``counters`` of any shape broadcasting against
    ``words[..., 0]``, the result is ``uniform(key, shape).ravel()[counter]`` for each
    key and counter (JAX's partitionable threefry: a word is the hash of its flat index).
    """
    c = counters.astype(jnp.uint32)
    b0, b1 = threefry2x32(words[..., 0], words[..., 1], jnp.zeros_like(c), c)
    mantissa = ((b0 ^ b1) >> np.uint32(9)) | np.uint32(0x3F800000)  # in [1, 2)
    return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0


def uniform(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """float32 uniforms on ``[0, 1)``: exactly ``jax.random.uniform(key, shape)``.

    ``key``: one PRNG key (typed, or a raw ``uint32[2]``). Built as JAX builds it: the
    top 23 bits of each word under exponent 0, minus 1.
    """
    shape = tuple(int(s) for s in shape)
    size = int(np.prod(shape, dtype=np.int64))
    words = _threefry_key_words(key)
    if words is None or not jax.config.jax_threefry_partitionable or size >= 2**32:  # type: ignore[attr-defined]
        return jax.random.uniform(key, shape)
    return uniform_window(words, jax.lax.iota(jnp.uint32, size)).reshape(shape)


def bernoulli(key: jax.Array, p: float, shape: Sequence[int]) -> jax.Array:
    """Exactly ``jax.random.bernoulli(key, p, shape)`` for a float ``p`` (``uniform < p``)."""
    return uniform(key, shape) < p
