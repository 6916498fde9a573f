"""The ``"pairs"`` estimator on an edge list: absent pairs valued from a few probes per row.

On the dense path (:mod:`sbm_jax.kernels.dense`) the ``"pairs"`` estimator sends every
real pair ``(i, j)`` the first-order change of the loss when the pair is flipped: the
logit cotangent ``da_e`` on a sampled edge, ``sigma_ij (dOut_i . v_j - D_i)`` on an
absent pair (``sigma_ij = sigmoid(s_ij - lse_i)``, the weight the pair would take if it
were added; 1 in a row without edges; ``D_i = dOut_i . out_i``), plus the edge count's
cotangent on every real pair. An edge list has no absent pairs to visit, so here their
sum over a row is estimated from ``R`` probe keys per query row, drawn uniformly with
replacement from the real keys: a probe that hits an edge counts 0, any other counts
``m_real / R`` times its gain, so the estimate of ``sum_{j absent} gain_ij dp_ij`` is
unbiased. With ``R >= m`` the probes are every key once (weight 1): exact.

:func:`absent_pair_term` is 0 in the forward pass and carries that estimate in its
backward pass (to ``ys`` and ``z`` only; the queries, keys and values get their
gradients from the attention itself), so the forward pass is unchanged. Cost: O(n R d)
for the probe scores and ``dOut . v`` products, O(C d) for the rows' log-normalisers
(recomputed from the edges), and O(n R k) for the membership products, in the backward
pass only. The count's term has a closed form: ``sum_{ij real} p_ij = (sum_i ys_i) .
(sum_j z_j)`` (:func:`expected_pair_sum`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

#: Probe keys per query row of the ``"pairs"`` estimator on the sparse path.
DEFAULT_PAIR_PROBES = 16


def probe_columns(
    key: jax.Array, k_mask: jax.Array, num_rows: int, probes: int
) -> tuple[jax.Array, jax.Array]:
    """``(cols [n, R] int32, weight [] float32)``: probe keys per query row.

    ``R = probes`` keys per row drawn uniformly with replacement from the real keys
    (``k_mask``), each weighted ``m_real / R``; with ``probes >= m`` every key once
    (``R = m``, weight 1; padded keys are masked by the caller).
    """
    m = k_mask.shape[0]
    if probes >= m:
        cols = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (num_rows, m))
        return cols, jnp.float32(1.0)
    real = jnp.sum(k_mask.astype(jnp.int32))
    u = jax.random.randint(key, (num_rows, probes), 0, jnp.maximum(real, 1))
    # The u-th real key: the first position where the running count of real keys is u + 1.
    cols = jnp.searchsorted(jnp.cumsum(k_mask.astype(jnp.int32)), u + 1, side="left")
    cols = jnp.minimum(cols, m - 1).astype(jnp.int32)
    return cols, real.astype(jnp.float32) / probes


def expected_pair_sum(
    ys: jax.Array, z: jax.Array, q_mask: jax.Array, k_mask: jax.Array
) -> jax.Array:
    """``sum_{i, j} p_ij`` over real pairs, ``p = ys z[:, :k]^T``: ``(sum_i ys_i) .
    (sum_j z_j)`` over real rows, O((n + m) k)."""
    kc = ys.shape[1]
    f32 = jnp.float32
    rows = jnp.sum(jnp.where(q_mask[:, None], ys.astype(f32), 0.0), 0)
    cols = jnp.sum(jnp.where(k_mask[:, None], z[:, :kc].astype(f32), 0.0), 0)
    return jnp.dot(rows, cols)


@jax.custom_vjp
def absent_pair_term(q, k, v, out, ys, z, keys, cols, weight, q_mask, k_mask):
    """Zero ``[n, dv]`` (batched like ``out``); its backward pass sends the probes'
    estimate of the absent pairs' gains to ``ys`` and ``z`` (module docstring).

    ``q [n, d]``, ``k [m, d]``, ``v [m, dv]``; ``out [n, dv]`` the attention output on the
    edges; ``ys [n, k]``, ``z [m, K >= k]``; ``keys [C]`` the sorted edge keys ``i * m + j``
    (sentinel ``n * m`` in empty slots); ``cols [n, R]``, ``weight []`` from
    :func:`probe_columns`; ``q_mask [n]``, ``k_mask [m]`` the real tokens. Add the result
    to ``out``: the cotangent it receives is the output's.
    """
    del q, k, v, ys, z, keys, cols, weight, q_mask, k_mask
    return out * 0.0


def _term_fwd(q, k, v, out, ys, z, keys, cols, weight, q_mask, k_mask):
    res = (q, k, v, out, ys, z, keys, cols, weight, q_mask, k_mask)
    return out * 0.0, res


def _row_lse(q, k, keys, n, m):
    """Each row's log-normaliser over its edges (0 for a row without edges) and whether
    the row has an edge; the scores are recomputed from the edge keys, O(C d)."""
    f32 = jnp.float32
    valid = keys != n * m
    rows = jnp.where(valid, keys // m, n - 1)
    ecols = jnp.where(valid, keys % m, 0)
    s = jnp.sum(q[rows].astype(f32) * k[ecols].astype(f32), -1) / math.sqrt(q.shape[-1])
    s = jnp.where(valid, s, -jnp.inf)
    mx = jax.ops.segment_max(s, rows, num_segments=n, indices_are_sorted=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    den = jax.ops.segment_sum(
        jnp.where(valid, jnp.exp(s - mx[rows]), 0.0), rows, num_segments=n, indices_are_sorted=True
    )
    has = den > 0
    return jnp.where(has, mx + jnp.log(jnp.where(has, den, 1.0)), 0.0), has


def _term_bwd(res, dout):
    q, k, v, out, ys, z, keys, cols, weight, q_mask, k_mask = res
    f32 = jnp.float32
    n, m, kc = q.shape[0], k.shape[0], ys.shape[1]
    dout = dout.astype(f32)
    big_d = jnp.sum(dout * out.astype(f32), -1)  # [n]
    lse, has = _row_lse(q, k, keys, n, m)
    s = jnp.einsum("nd,nrd->nr", q.astype(f32), k[cols].astype(f32)) / math.sqrt(q.shape[-1])
    sigma = jnp.where(has[:, None], jax.nn.sigmoid(s - lse[:, None]), 1.0)
    dw = jnp.einsum("nd,nrd->nr", dout, v[cols].astype(f32))
    gain = sigma * (dw - big_d[:, None])
    pair = jnp.arange(n, dtype=keys.dtype)[:, None] * m + cols
    at = jnp.minimum(jnp.searchsorted(keys, pair), keys.shape[0] - 1)
    present = keys[at] == pair
    ok = q_mask[:, None] & k_mask[cols] & ~present
    g = jnp.where(ok, gain * weight, 0.0)  # [n, R]: cotangent of p on the probes
    zc = z[:, :kc].astype(f32)
    dys = jnp.einsum("nr,nrk->nk", g, zc[cols])
    dz_k = (
        jnp.zeros((m, kc), f32)
        .at[cols.reshape(-1)]
        .add((g[:, :, None] * ys.astype(f32)[:, None, :]).reshape(-1, kc))
    )
    dz = jnp.zeros(z.shape, f32).at[:, :kc].set(dz_k)
    zeros = jnp.zeros_like
    return (
        zeros(q),
        zeros(k),
        zeros(v),
        zeros(out),
        dys.astype(ys.dtype),
        dz.astype(z.dtype),
        None,
        None,
        zeros(weight),
        None,
        None,
    )


absent_pair_term.defvjp(_term_fwd, _term_bwd)


def with_absent_pairs(
    key: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    ys: jax.Array,
    z: jax.Array,
    keys: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    *,
    probes: int = DEFAULT_PAIR_PROBES,
) -> tuple[jax.Array, jax.Array]:
    """The ``"pairs"`` estimator's terms on an edge list, for attention computed with the
    edge logits ``s_e + (M_ste - 1)`` (so each edge's ``dL/dM`` is its logit cotangent).

    Returns ``(out + absent_pair_term(...), count)``: the output (unchanged in value),
    whose backward pass adds the probes' estimate of the absent pairs' gains, and the
    edge count (the number of edges in value) whose cotangent reaches every real pair
    through :func:`expected_pair_sum` instead of the sampled edges only. ``key`` draws
    the probes (:func:`probe_columns`).
    """
    n, m = q.shape[0], k.shape[0]
    cols, weight = probe_columns(key, k_mask, n, probes)
    out = out + absent_pair_term(
        q, k, v, jax.lax.stop_gradient(out), ys, z, keys, cols, weight, q_mask, k_mask
    )
    expected = expected_pair_sum(ys, z, q_mask, k_mask)
    num = jax.lax.stop_gradient(jnp.sum(keys != n * m).astype(jnp.float32))
    return out, num + expected - jax.lax.stop_gradient(expected)
