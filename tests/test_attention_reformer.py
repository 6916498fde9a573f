"""Reformer LSH attention against dense and loop references."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention.reformer import ReformerAttention, lsh_attention, lsh_buckets
from tests.attention_testing import (
    assert_grads_finite_and_traced_once,
    assert_padding_invariant,
    dense_out,
    dense_qkv,
    module_inputs,
    token_mask,
)


def dense_shared_qk_reference(qk, v, mask, causal):
    """Full attention with keys qk/|qk|, no self-attention unless a token has no other key."""
    qk, v = np.asarray(qk, np.float64), np.asarray(v, np.float64)
    mask = np.asarray(mask)
    batch, n, heads, d = qk.shape
    keys = qk / np.linalg.norm(qk, axis=-1, keepdims=True)
    out = np.zeros((batch, n, heads, v.shape[-1]))
    for bi in range(batch):
        for h in range(heads):
            for i in range(n):
                if not mask[bi, i]:
                    continue
                others = [j for j in range(n) if mask[bi, j] and j != i and (j <= i or not causal)]
                if not others:
                    out[bi, i, h] = v[bi, i, h]
                    continue
                s = keys[bi, others, h] @ qk[bi, i, h] / math.sqrt(d)
                w = np.exp(s - s.max())
                out[bi, i, h] = (w / w.sum()) @ v[bi, others, h]
    return out


def loop_lsh_reference(qk, v, mask, buckets, num_buckets, chunk_len):
    """Sort by (bucket, position) with padding last, chunk, attend to own + previous chunk
    (circular over the chunks up to the last one holding a real token), self logit -1e5,
    padded keys -1e9; rounds combined by softmax of lse."""
    qk, v = np.asarray(qk, np.float64), np.asarray(v, np.float64)
    mask, buckets = np.asarray(mask), np.asarray(buckets)
    batch, n, heads, d = qk.shape
    rounds = buckets.shape[1]
    keys = qk / np.linalg.norm(qk, axis=-1, keepdims=True)
    length = min(chunk_len, n)
    nc = -(-n // length)
    out = np.zeros((batch, n, heads, v.shape[-1]))
    for bi in range(batch):
        for h in range(heads):
            outs = np.zeros((rounds, n, v.shape[-1]))
            lses = np.zeros((rounds, n))
            for r in range(rounds):
                real = [i for i in range(n) if mask[bi, i]]
                pads = [i for i in range(n) if not mask[bi, i]]
                order = sorted(real, key=lambda i: (buckets[bi, r, h, i], i)) + pads
                order += [None] * (nc * length - n)  # filler slots
                chunks = [order[c * length : (c + 1) * length] for c in range(nc)]
                # The circle closes at the last chunk holding a real token.
                last = max((c for c in range(nc) if any(i in real for i in chunks[c])), default=0)
                for c in range(nc):
                    before = c - 1 if c > 0 else last
                    view = chunks[c] + (chunks[before] if before != c else [])
                    for i in chunks[c]:
                        if i is None:
                            continue
                        s = []
                        for j in view:
                            if j is None or not mask[bi, j]:
                                s.append(-1e9)
                            elif j == i:
                                s.append(-1e5)
                            else:
                                s.append(keys[bi, j, h] @ qk[bi, i, h] / math.sqrt(d))
                        s = np.asarray(s)
                        lse = s.max() + np.log(np.sum(np.exp(s - s.max())))
                        w = np.exp(s - lse)
                        vals = np.stack(
                            [v[bi, j, h] if j is not None else 0 * v[bi, 0, h] for j in view]
                        )
                        outs[r, i] = w @ vals
                        lses[r, i] = lse
            rw = np.exp(lses - lses.max(0))
            rw /= rw.sum(0)
            out[bi, :, h] = np.sum(rw[..., None] * outs, axis=0)
    return out


def init_params(module, key, x, mask):
    """Unboxed deterministic variables of `module`: one compiled program, not op by op."""
    return nn.unbox(jax.jit(lambda k, x, m: module.init(k, x, m, deterministic=True))(key, x, mask))


def test_lsh_buckets_match_argmax_of_rotations():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 4))
    rot = jax.random.normal(jax.random.key(1), (2, 3, 4, 3))  # 6 buckets
    got = np.asarray(jax.jit(lsh_buckets)(x, rot))
    xn, rn = np.asarray(x), np.asarray(rot)
    for b in range(2):
        for r in range(2):
            for h in range(3):
                for i in range(5):
                    proj = xn[b, i, h] @ rn[r, h]
                    assert got[b, r, h, i] == int(np.argmax(np.concatenate([proj, -proj])))


@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_equals_full_attention_without_self(causal):
    n = 7
    x = jax.random.normal(jax.random.key(2), (3, n, 8))
    mask = token_mask(n, (7, 4, 1))  # the last example has a single real token
    module = ReformerAttention(
        num_heads=2, head_dim=4, out_dim=8, num_hashes=1, num_buckets=1, chunk_len=16, causal=causal
    )
    params = init_params(module, jax.random.key(3), x, mask)
    out = jax.jit(lambda p, x, m: module.apply(p, x, m, deterministic=True))(params, x, mask)
    qk, v = dense_qkv(params, x, names=("query_key", "value"))
    ref = dense_out(params, dense_shared_qk_reference(qk, v, mask, causal))
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[m], ref[m], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "n,chunk_len,num_buckets",
    [(10, 3, 4), (8, 4, 2), pytest.param(6, 2, 6, marks=pytest.mark.slow)],
)
def test_chunked_multi_round_matches_loop_reference(n, chunk_len, num_buckets):
    kq, kv, kb = jax.random.split(jax.random.key(n), 3)
    qk = jax.random.normal(kq, (2, n, 2, 4))
    v = jax.random.normal(kv, (2, n, 2, 3))
    mask = token_mask(n, (n, n - 3))
    buckets = jax.random.randint(kb, (2, 2, 2, n), 0, num_buckets)
    fn = jax.jit(lsh_attention, static_argnums=(4, 5))
    out = fn(qk, v, mask, buckets, num_buckets, chunk_len)
    ref = loop_lsh_reference(qk, v, mask, buckets, num_buckets, chunk_len)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[m], ref[m], rtol=1e-5, atol=1e-6)


def test_padding_never_influences_real_tokens():
    x, mask = module_inputs(4)
    module = ReformerAttention(num_heads=2, head_dim=4, out_dim=8, chunk_len=3, num_buckets=4)
    params = init_params(module, jax.random.key(5), x, mask)
    noise = 50.0 * jax.random.normal(jax.random.key(6), x.shape)
    apply = jax.jit(
        lambda x: module.apply(
            params, x, mask, deterministic=True, rngs={"sample": jax.random.key(7)}
        )
    )
    assert_padding_invariant(apply, x, mask, noise)


@pytest.mark.parametrize("num_hashes", [1, 2])
def test_appended_padding_changes_no_real_output(num_hashes):
    """Real tokens' outputs do not depend on how much padding follows them, even when the
    padding adds whole chunks (chunk 0 must keep looking back at the last real chunk).
    Lengths (10, 5) with chunk_len 4: the padded lengths 13 and 16 add a fourth chunk."""
    n, dim = 10, 8
    x = jax.random.normal(jax.random.key(20), (2, n, dim))
    mask = token_mask(n, (10, 5))
    module = ReformerAttention(
        num_heads=2, head_dim=4, out_dim=dim, num_hashes=num_hashes, chunk_len=4, num_buckets=4
    )
    params = init_params(module, jax.random.key(21), x, mask)
    apply = jax.jit(lambda x, m: module.apply(params, x, m, deterministic=True))
    base = np.asarray(apply(x, mask))
    # The unpadded outputs themselves against the loop reference (float64).
    qk, v = dense_qkv(params, x, names=("query_key", "value"))
    rot = jax.random.normal(jax.random.key(0), (num_hashes, 2, 4, 2))  # hash_seed 0
    buckets = lsh_buckets(qk, rot)
    ref = dense_out(params, loop_lsh_reference(qk, v, mask, buckets, 4, 4))
    m = np.asarray(mask)
    np.testing.assert_allclose(base[m], ref[m], rtol=1e-4, atol=1e-5)
    for pad in (1, 2, 3, 6, 9):
        xp = jnp.concatenate([x, jax.random.normal(jax.random.key(pad), (2, pad, dim))], 1)
        mp = jnp.concatenate([mask, jnp.zeros((2, pad), bool)], 1)
        out = np.asarray(apply(xp, mp))[:, :n]
        np.testing.assert_allclose(out[m], base[m], rtol=1e-5, atol=1e-6, err_msg=f"pad {pad}")


def test_hash_rng_sample_stream_and_fixed_key(monkeypatch):
    import sbm_jax.attention.reformer as reformer

    x, mask = module_inputs(4)
    module = ReformerAttention(
        num_heads=2, head_dim=4, out_dim=8, chunk_len=3, num_buckets=4, num_hashes=2, hash_seed=3
    )
    params = init_params(module, jax.random.key(8), x, mask)

    @jax.jit
    def apply(rng):
        return module.apply(params, x, mask, deterministic=True, rngs={"sample": rng})

    fixed = jax.jit(lambda: module.apply(params, x, mask, deterministic=True))
    assert not np.allclose(apply(jax.random.key(0)), apply(jax.random.key(1)))

    # The rotations each call hashes with, read where the layer passes them on (eagerly,
    # so they are values), and each output against the loop reference (float64) that
    # hashes with them: outputs are the LSH attention of the rotations they were drawn
    # with, the same on every call for the same rng.
    seen = []

    def recording(qk, rotations):
        seen.append(np.asarray(rotations))
        return lsh_buckets(qk, rotations)

    monkeypatch.setattr(reformer, "lsh_buckets", recording)
    module.apply(params, x, mask, deterministic=True)
    module.apply(params, x, mask, deterministic=True, rngs={"sample": jax.random.key(0)})
    monkeypatch.undo()
    fixed_rot, sample_rot = seen
    # Without a sample stream: the fixed key hash_seed.
    np.testing.assert_array_equal(fixed_rot, jax.random.normal(jax.random.key(3), (2, 2, 4, 2)))
    assert not np.allclose(sample_rot, fixed_rot)  # with one: drawn from the stream
    qk, v = dense_qkv(params, x, names=("query_key", "value"))
    m = np.asarray(mask)
    for got, rot in ((fixed(), fixed_rot), (apply(jax.random.key(0)), sample_rot)):
        buckets = lsh_buckets(qk, jnp.asarray(rot))
        ref = dense_out(params, loop_lsh_reference(qk, v, mask, buckets, 4, 3))
        np.testing.assert_allclose(np.asarray(got)[m], ref[m], rtol=1e-4, atol=1e-5)


def test_gradients_finite_and_no_retrace():
    x, mask = module_inputs(4)
    module = ReformerAttention(
        num_heads=2, head_dim=4, out_dim=8, chunk_len=4, attention_dropout=0.1
    )
    params = {"params": init_params(module, jax.random.key(9), x, mask)["params"]}

    def apply(params, x, rng):
        r1, r2 = jax.random.split(rng)
        return module.apply(
            params, x, mask, deterministic=False, rngs={"dropout": r1, "sample": r2}
        )

    assert_grads_finite_and_traced_once(apply, params, x.shape)


def test_bad_options_name_the_field():
    x, mask = module_inputs(4)
    for options, field in [({"num_buckets": 3}, "num_buckets"), ({"num_hashes": 0}, "num_hashes")]:
        with pytest.raises(ValueError, match=f"attention_options.{field}"):
            ReformerAttention(num_heads=1, head_dim=4, out_dim=8, **options).init(
                jax.random.key(0), x, mask, deterministic=True
            )
