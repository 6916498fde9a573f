"""The streamed dense path (sbm_jax/kernels/dense.py): law, numbers, and no n x m array.

References are independent: the law against its closed form (chi-square over pairs),
outputs and gradients against numpy float64 on the same mask with the gradients
written out by hand (eq. 9, the released code's clipped estimator, and the
``"pairs"`` estimator with each absent pair added to its row by hand), a row's total
drive against the derivative of a masked softmax in its score scale, and the
program's shapes read from its jaxpr.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.kernels.dense import (
    default_block_rows,
    streamed_mask,
    streamed_sbm_attention,
)

N, M, K, D, DV = 21, 19, 3, 4, 5
Q_MASK = np.arange(N) < 17
K_MASK = np.arange(M) < 15


def _inputs(seed=0, zero_rows=(3, 11)):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(N, D))
    k = rng.normal(size=(M, D))
    v = rng.normal(size=(M, DV))
    g = rng.normal(size=(N, DV))
    ys = rng.random((N, K)) * 0.4 * Q_MASK[:, None]
    ys[list(zero_rows)] = 0.0  # with delta = 0 these rows have no sampled edge
    zk = rng.random((M, K)) * K_MASK[:, None]
    return q, k, v, g, ys, zk


def _f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


# One program per call (shared by the tests below), not op-by-op compiles.
_streamed_mask = jax.jit(streamed_mask, static_argnames=("law", "forced_half", "block_rows"))


# ----------------------------------------------------------------------------- the law
@pytest.mark.parametrize("law", ["bernoulli", "poisson"])
def test_mask_has_the_law_and_never_touches_padding(law):
    trials, delta = 4000, 0.05
    _, _, _, _, ys, zk = _inputs(1, zero_rows=())
    ys = ys * 2.0  # some p + delta above 1: certain pairs under bernoulli
    p = ys @ zk.T
    rate = p + delta
    want = np.minimum(rate, 1.0) if law == "bernoulli" else 1.0 - np.exp(-rate)
    real = Q_MASK[:, None] & K_MASK[None, :]
    keys = jax.random.split(jax.random.PRNGKey(0), trials)

    def draws(ys, keys):  # one mask per key, all in one jitted program
        one = lambda kk: streamed_mask(  # noqa: E731
            kk,
            *_f32(ys, zk),
            jnp.asarray(Q_MASK),
            jnp.asarray(K_MASK),
            delta,
            law=law,
            block_rows=4,
        )
        return np.asarray(jax.jit(jax.vmap(one))(keys))

    masks = draws(ys, keys)
    freq = masks.mean(0)
    assert not masks[:, ~real].any(), "an edge touched a padded query or key"
    t = want[real]
    var = t * (1 - t) / trials
    z2 = np.where(var > 0, (freq[real] - t) ** 2 / np.maximum(var, 1e-12), 0.0)
    df = int(np.sum(var > 0))
    # Sum of squared z-scores ~ chi2(df): mean df, sd sqrt(2 df).
    assert abs(z2.sum() - df) < 6 * np.sqrt(2 * df), (z2.sum(), df)
    assert np.max(z2) < 36.0
    if law == "bernoulli":
        assert (want[real] == 1.0).any() and np.all(freq[real][t == 1.0] == 1.0)
    # Blocks draw independent uniforms (the key is folded with the block index): two
    # blocks with the same probabilities agree on a pair only as often as independent
    # draws would, p^2 + (1 - p)^2, not always.
    same = np.tile(ys[:4], (N // 4 + 1, 1))[:N] * Q_MASK[:, None]
    masks = draws(same, keys[:500])
    a, b = masks[:, 0:4][:, :, K_MASK], masks[:, 4:8][:, :, K_MASK]
    pr = (want[0:4][:, K_MASK])[None]
    agree = np.mean(a == b)
    expected = np.mean(pr**2 + (1 - pr) ** 2)
    assert abs(agree - expected) < 0.03, (agree, expected)


def test_forced_edges_are_always_present_on_real_pairs():
    _, _, _, _, ys, zk = _inputs(2)
    for half, want_fn in ((0, lambda i, j: i == j), (2, lambda i, j: abs(i - j) <= 2)):
        mask = np.asarray(
            _streamed_mask(
                jax.random.PRNGKey(5),
                *_f32(ys * 0.0, zk),
                jnp.asarray(Q_MASK),
                jnp.asarray(K_MASK),
                0.0,
                forced_half=half,
                block_rows=4,
            )
        )
        want = np.array(
            [[want_fn(i, j) and Q_MASK[i] and K_MASK[j] for j in range(M)] for i in range(N)]
        )
        np.testing.assert_array_equal(mask, want)


# ----------------------------------------------------------------------------- numbers
def _numpy_reference(q, k, v, g, ys, zk, mask, c, ste, keep=None, rate=0.0):
    """float64: loss = sum(out * g) + c * (number of edges), and its gradients in q, k, v,
    ys, zk, written out by hand. ``keep``: dropout keep mask on the normalised weights."""
    q, k, v, g, ys, zk = (np.asarray(a, np.float64) for a in (q, k, v, g, ys, zk))
    d = q.shape[1]
    s = q @ k.T / np.sqrt(d)
    logit = np.where(mask, s, -np.inf)
    mx = np.max(logit, axis=1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(mask, np.exp(np.where(mask, s, 0.0) - mx), 0.0)
    den = e.sum(1, keepdims=True)
    a = e / np.where(den > 0, den, 1.0)
    z = np.ones_like(a) if keep is None else np.where(keep, 1.0 / (1.0 - rate), 0.0)
    out = (a * z) @ v
    loss = np.sum(out * g) + c * mask.sum()
    g_a = (g @ v.T) * z  # dL/da
    da = a * (g_a - np.sum(a * g_a, axis=1, keepdims=True))  # logit cotangent
    dq = (da / np.sqrt(d)) @ k
    dk = (da / np.sqrt(d)).T @ q
    dv = (a * z).T @ g
    if ste == "paper":  # eq. 9: logit = s * M, dL/dM = da * s (+ the count's c)
        dm = da * s + c
    elif ste == "reference":  # released code: dL/dM = da (+ c), clipped to [-1, 1]
        dm = np.clip(da + c, -1.0, 1.0)
    elif ste == "pairs":  # every real pair: the first-order change of L when flipped
        dm = np.where(mask, da + c, 0.0)
        for i, j in zip(*np.nonzero(~mask & Q_MASK[:, None] & K_MASK[None, :]), strict=True):
            # Add pair (i, j) to row i by hand and recompute that row's output.
            keep_e = e[i] * z[i]
            e_j = np.exp(s[i, j] - mx[i, 0])
            new_out = (keep_e @ v + e_j * z[i, j] * v[j]) / (den[i, 0] + e_j)
            dm[i, j] = np.dot(g[i], new_out - out[i]) + c
    else:  # "noclip": the released code's dL/dM without its clip (to check the case)
        dm = da + c
    dp = dm if ste == "pairs" else np.where(mask, dm, 0.0)
    return out, loss, (dq, dk, dv, dp @ zk, dp.T @ ys)


@pytest.mark.parametrize("ste", ["paper", "reference", "pairs"])
@pytest.mark.parametrize("block_rows, half, rate", [(4, None, 0.0), (8, 1, 0.0), (None, None, 0.3)])
def test_outputs_and_gradients_match_numpy_on_the_same_mask(ste, block_rows, half, rate):
    q, k, v, g, ys, zk = _inputs(3)
    g = 6.0 * g  # large cotangents: the reference estimator's clip is active
    c = 0.4
    key, drop_key = jax.random.PRNGKey(7), jax.random.PRNGKey(8)
    masks = (jnp.asarray(Q_MASK), jnp.asarray(K_MASK))

    def loss(q, k, v, ys, zk):
        out, count = streamed_sbm_attention(
            key,
            q,
            k,
            v,
            ys,
            zk,
            *masks,
            0.0,
            ste=ste,
            forced_half=half,
            dropout_rate=rate,
            dropout_rng=drop_key if rate else None,
            block_rows=block_rows,
        )
        return jnp.sum(out * jnp.asarray(g, jnp.float32)) + c * count, out

    args = _f32(q, k, v, ys, zk)
    (val, out), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(*args)
    mask = _streamed_mask(key, *_f32(ys, zk), *masks, 0.0, forced_half=half, block_rows=block_rows)
    mask = np.asarray(mask)
    keep = None
    if rate:  # the documented dropout draw: block b's keep mask from fold_in(drop_key, b)
        bq = block_rows or default_block_rows(N, M)
        nb = -(-N // bq)
        keep_b = jax.jit(
            lambda b: jax.random.bernoulli(jax.random.fold_in(drop_key, b), 1 - rate, (bq, M))
        )
        keep = np.concatenate([np.asarray(keep_b(b)) for b in range(nb)])[:N]
    ref_out, ref_loss, ref_grads = _numpy_reference(q, k, v, g, ys, zk, mask, c, ste, keep, rate)
    empty = ~mask.any(1)
    assert empty[[3, 11]].all() if half is None else empty[~Q_MASK].all()
    assert np.all(np.asarray(out)[empty] == 0.0), "rows without an edge output exactly 0"
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val, ref_loss, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "ys", "zk"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)
    if ste == "reference":
        _, _, unclipped = _numpy_reference(q, k, v, g, ys, zk, mask, c, "noclip", keep, rate)
        assert not np.allclose(unclipped[3], ref_grads[3]), "the case should exercise the clip"


@pytest.mark.parametrize("ste", ["paper", "reference"])
def test_a_rows_density_drive_is_its_score_temperature_gradient_or_zero(ste):
    # Every key with the same memberships: p_ij = p_i for all j, so d(ys_i) . ys_i =
    # p_i * sum_j dL/dp_ij, the drive on row i's density as a whole. Under eq. 9 it is
    # p_i * dL/d beta_i, beta_i a common scale of row i's scores; under the released
    # code's estimator it is 0 (a row's logit cotangents sum to zero). The reference
    # scales the scores of a masked softmax written here and differentiates in beta.
    q, k, v, g, ys, zk = _inputs(6)
    zk = np.where(K_MASK[:, None], zk[:1], 0.0)  # one membership row for every real key
    key = jax.random.PRNGKey(11)
    masks = (jnp.asarray(Q_MASK), jnp.asarray(K_MASK))
    g = 0.1 * g  # small cotangents: the released code's clip stays inactive
    q, k, v, g, ys, zk = _f32(q, k, v, g, ys, zk)

    def loss_in_ys(ys):
        out, _ = streamed_sbm_attention(key, q, k, v, ys, zk, *masks, 0.0, ste=ste)
        return jnp.sum(out * g)

    drive = np.sum(np.asarray(jax.jit(jax.grad(loss_in_ys))(ys)) * np.asarray(ys), axis=1)
    mask = jnp.asarray(_streamed_mask(key, ys, zk, *masks, 0.0))

    def loss_in_beta(beta):  # masked softmax with row i's scores times beta_i
        s = beta[:, None] * (q @ k.T) / np.sqrt(D)
        a = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=1)
        a = jnp.where(mask.any(1, keepdims=True), a, 0.0)
        return jnp.sum((a @ v) * g)

    d_beta = np.asarray(jax.jit(jax.grad(loss_in_beta))(jnp.ones(N)))
    p_row = np.asarray(ys @ zk[0])
    want = p_row * d_beta if ste == "paper" else np.zeros(N)
    assert np.abs(d_beta[np.asarray(mask).sum(1) > 1]).min() > 1e-4, "the case has a signal"
    np.testing.assert_allclose(drive, want, rtol=1e-4, atol=1e-5)


def test_under_vmap_every_graph_keeps_its_own_gradient():
    # The layer maps the path over (example, head) with vmap on accelerators.
    q, k, v, g, ys, zk = _inputs(4)
    q2, k2, v2, g2, ys2, zk2 = _inputs(5)
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    stack = lambda a, b: jnp.stack(_f32(a, b))  # noqa: E731
    batch = [stack(a, b) for a, b in ((q, q2), (k, k2), (v, v2), (ys, ys2), (zk, zk2))]
    gs = stack(g, g2)
    masks = (jnp.asarray(Q_MASK), jnp.asarray(K_MASK))

    def one(key, q, k, v, ys, zk, g):
        out, count = streamed_sbm_attention(key, q, k, v, ys, zk, *masks, 0.05, block_rows=8)
        return jnp.sum(out * g) + 0.3 * count

    def total(*args):
        return jnp.sum(jax.vmap(one)(keys, *args, gs))

    grads = jax.jit(jax.grad(total, argnums=range(5)))(*batch)
    single_grad = jax.jit(jax.grad(one, argnums=range(1, 6)))
    for i in range(2):
        single = single_grad(keys[i], *(a[i] for a in batch), gs[i])
        for a, b in zip(grads, single, strict=True):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- memory
def _max_intermediate(jaxpr) -> int:
    """Largest number of elements of any value anywhere in ``jaxpr`` (sub-jaxprs too)."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            biggest = max(biggest, int(np.prod(shape)) if shape else 1)
        for param in eqn.params.values():
            subs = param if isinstance(param, (list, tuple)) else [param]
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    biggest = max(biggest, _max_intermediate(inner))
    return biggest


def test_no_n_by_m_array_in_the_layer_dense_path_forward_or_backward():
    from sbm_jax.attention.sbm import sbm_attention_core

    b, h, n, kc, d = 2, 2, 2048, 8, 8
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q, k, v = (jax.random.normal(kk, (b, h, n, d)) for kk in ks[:3])
    qm, km = (jax.random.uniform(kk, (b, h, n, kc)) for kk in ks[3:5])
    blk = jax.nn.softmax(jax.random.normal(ks[5], (h, kc * kc))).reshape(h, kc, kc)
    mask = jnp.ones((b, n), bool)

    def loss(q, k, v, qm, blk, km):
        out, st = sbm_attention_core(
            jax.random.PRNGKey(1),
            q,
            k,
            v,
            qm,
            blk,
            km,
            mask,
            delta=0.01,
            impl="dense",
            window=4,
        )
        return jnp.sum(out**2) + jnp.sum(st["density"])

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(q, k, v, qm, blk, km)
    bq = default_block_rows(n, n)
    assert bq * n <= n * n // 16
    # The largest value is one block's tile (bq x m) or the [B, H, n, k] memberships,
    # never an n x m array.
    assert _max_intermediate(jaxpr.jaxpr) <= max(bq * n, b * h * n * max(kc, d) * 2)
    assert _max_intermediate(jaxpr.jaxpr) < n * n


def _pairs_dm(q, k, v, g, mask, c, keep, rate, q_mask, k_mask):
    """float64, vectorised: the ``"pairs"`` estimator's dL/dM on every real pair (the
    same formula as :func:`_numpy_reference`'s loop: an absent pair added by hand)."""
    d = q.shape[1]
    s = q @ k.T / np.sqrt(d)
    mx = np.max(np.where(mask, s, -np.inf), axis=1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e_all = np.exp(s - mx)
    e = np.where(mask, e_all, 0.0)
    den = e.sum(1, keepdims=True)
    a = e / np.where(den > 0, den, 1.0)
    z = np.ones_like(a) if keep is None else np.where(keep, 1.0 / (1.0 - rate), 0.0)
    out = (a * z) @ v
    g_a = (g @ v.T) * z
    da = a * (g_a - np.sum(a * g_a, axis=1, keepdims=True))
    num = (e * z) @ v  # [n, dv]: the row's unnormalised output
    gv = g @ v.T  # [n, m]
    added = (np.sum(g * num, 1, keepdims=True) + e_all * z * gv) / (den + e_all)
    dm_absent = added - np.sum(g * out, 1, keepdims=True) + c
    real = q_mask[:, None] & k_mask[None, :]
    return np.where(mask, da + c, np.where(real, dm_absent, 0.0))


@pytest.mark.parametrize("ste, half, rate", [("paper", 2, 0.0), ("pairs", None, 0.2)])
def test_backward_tiles_across_key_chunks_and_row_blocks_match_numpy(ste, half, rate):
    # n and m past one backward tile in both directions, neither a multiple of it (the
    # last key chunk and the last row tile are partial), several forward blocks per
    # tile: the backward pass's windows of the forward's uniforms must give its mask.
    from sbm_jax.kernels.dense import KEY_CHUNK

    n, m, kc, d = 1100, 1030, 3, 4
    assert m > 2 * KEY_CHUNK and m % KEY_CHUNK
    rng = np.random.default_rng(5)
    q_mask, k_mask = np.arange(n) < 1070, np.arange(m) < 1000
    q, k, v, g = (rng.normal(size=s) for s in ((n, d), (m, d), (m, d), (n, d)))
    ys = rng.random((n, kc)) * 0.1 * q_mask[:, None]
    ys[:40] = 0.0  # rows with few or no edges (delta 0)
    zk = rng.random((m, kc)) * k_mask[:, None]
    c = 0.3
    key, drop_key = jax.random.PRNGKey(11), jax.random.PRNGKey(12)
    masks = (jnp.asarray(q_mask), jnp.asarray(k_mask))

    def loss(q, k, v, ys, zk):
        out, count = streamed_sbm_attention(
            key, q, k, v, ys, zk, *masks, 0.0, ste=ste, forced_half=half,
            dropout_rate=rate, dropout_rng=drop_key if rate else None,
        )  # fmt: skip
        return jnp.sum(out * jnp.asarray(g, jnp.float32)) + c * count

    args = _f32(q, k, v, ys, zk)
    val, grads = jax.jit(jax.value_and_grad(loss, argnums=range(5)))(*args)
    mask = np.asarray(_streamed_mask(key, *_f32(ys, zk), *masks, 0.0, forced_half=half))
    assert 0.02 < mask.mean() < 0.5
    assert half is not None or (~mask[:40].any(1)).any(), "some rows without an edge"
    keep = None
    if rate:
        bq = default_block_rows(n, m)
        keep_b = jax.jit(
            lambda b: jax.random.bernoulli(jax.random.fold_in(drop_key, b), 1 - rate, (bq, m))
        )
        keep = np.concatenate([np.asarray(keep_b(b)) for b in range(-(-n // bq))])[:n]
    if ste == "paper":
        _, ref_loss, ref_grads = _numpy_reference(q, k, v, g, ys, zk, mask, c, ste, keep, rate)
    else:
        _, ref_loss, base = _numpy_reference(q, k, v, g, ys, zk, mask, c, "paper", keep, rate)
        dp = _pairs_dm(q, k, v, g, mask, c, keep, rate, q_mask, k_mask)
        ref_grads = (*base[:3], dp @ zk, dp.T @ ys)
    np.testing.assert_allclose(val, ref_loss, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "ys", "zk"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("ste", ["paper", "pairs"])
def test_without_partitionable_threefry_the_backward_takes_the_forwards_own_tiles(ste):
    # No window of a draw can be computed on its own under the non-partitionable scheme:
    # the backward pass then walks the forward's tiles (bq rows of all keys), same numbers.
    with jax.threefry_partitionable(False):
        test_outputs_and_gradients_match_numpy_on_the_same_mask(ste, 4, None, 0.3)
