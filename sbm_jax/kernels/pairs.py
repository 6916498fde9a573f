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
for the probe scores and ``dOut . v`` products and O(n R k) for the membership
products, in the backward pass only, walked in blocks of query rows
(:data:`PROBE_BLOCK_ELEMENTS`); the rows' log-normalisers are the attention kernel's own
(``edge_attention(..., return_lse=True)``). The count's term has a closed form:
``sum_{ij real} p_ij = (sum_i ys_i) . (sum_j z_j)`` (:func:`expected_pair_sum`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sbm_jax._varying import vary_like

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


#: Elements of the per-block ``[rows, R, k]`` membership gathers in the backward pass of
#: :func:`absent_pair_term` (1 MiB in float32): the probes are walked in blocks of query
#: rows so that no ``[n, R, k]`` temporary exists.
PROBE_BLOCK_ELEMENTS = 2**18


@jax.custom_vjp
def absent_pair_term(q, k, v, out, lse, ys, z, keys, cols, weight, q_mask, k_mask):
    """Zero ``[n, dv]`` (batched like ``out``); its backward pass sends the probes'
    estimate of the absent pairs' gains to ``ys`` and ``z`` (module docstring).

    ``q [n, d]``, ``k [m, d]``, ``v [m, dv]``; ``out [n, dv]`` the attention output on the
    edges and ``lse [n]`` its rows' log-normalisers (``edge_attention(...,
    return_lse=True)``); ``ys [n, k]``, ``z [m, K >= k]``; ``keys [C]`` the sorted edge
    keys ``i * m + j`` (sentinel ``n * m`` in empty slots); ``cols [n, R]``, ``weight []``
    from :func:`probe_columns`; ``q_mask [n]``, ``k_mask [m]`` the real tokens. Add the
    result to ``out``: the cotangent it receives is the output's.
    """
    del q, k, v, lse, ys, z, keys, cols, weight, q_mask, k_mask
    return out * 0.0


def _term_fwd(q, k, v, out, lse, ys, z, keys, cols, weight, q_mask, k_mask):
    res = (q, k, v, out, lse, ys, z, keys, cols, weight, q_mask, k_mask)
    return out * 0.0, res


def _rows_with_edges(keys: jax.Array, n: int, m: int) -> jax.Array:
    """``[n]`` bool: whether row ``i`` has an edge (a key in ``[i m, (i + 1) m)``);
    O(n log C) on the sorted keys."""
    bounds = jnp.searchsorted(keys, jnp.arange(n + 1, dtype=keys.dtype) * m, side="left")
    return bounds[1:] > bounds[:-1]


def _term_bwd(res, dout):
    q, k, v, out, lse, ys, z, keys, cols, weight, q_mask, k_mask = res
    f32 = jnp.float32
    n, m, kc = q.shape[0], k.shape[0], ys.shape[1]
    probes = cols.shape[1]
    dout = dout.astype(f32)
    big_d = jnp.sum(dout * out.astype(f32), -1)  # [n]
    has = _rows_with_edges(keys, n, m)
    zc = z[:, :kc].astype(f32)
    inv = 1.0 / math.sqrt(q.shape[-1])
    br = max(1, min(n, PROBE_BLOCK_ELEMENTS // (probes * kc)))
    pad = -n % br
    # Padded rows are masked out (q_mask False): their gains are 0.
    row_ops = (q.astype(f32), dout, big_d, lse.astype(f32), has, q_mask, cols, ys.astype(f32))
    row_ops = tuple(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) for a in row_ops)

    def block(i, carry):
        dys, dz = carry
        start = i * br
        qb, db, bd, lb, hb, mb, cb, yb = (
            jax.lax.dynamic_slice_in_dim(a, start, br) for a in row_ops
        )
        s = jnp.einsum("nd,nrd->nr", qb, k[cb].astype(f32)) * inv
        sigma = jnp.where(hb[:, None], jax.nn.sigmoid(s - lb[:, None]), 1.0)
        dw = jnp.einsum("nd,nrd->nr", db, v[cb].astype(f32))
        gain = sigma * (dw - bd[:, None])
        row = (start + jnp.arange(br, dtype=keys.dtype))[:, None]
        pair = row * m + cb
        at = jnp.minimum(jnp.searchsorted(keys, pair), keys.shape[0] - 1)
        present = keys[at] == pair
        ok = mb[:, None] & k_mask[cb] & ~present
        g = jnp.where(ok, gain * weight, 0.0)  # [br, R]: cotangent of p on the probes
        dys = jax.lax.dynamic_update_slice_in_dim(
            dys, jnp.einsum("nr,nrk->nk", g, zc[cb]), start, axis=0
        )
        dz = dz.at[cb.reshape(-1)].add((g[:, :, None] * yb[:, None, :]).reshape(-1, kc))
        return dys, dz

    init = vary_like((jnp.zeros((n + pad, kc), f32), jnp.zeros((m, kc), f32)), res, dout)
    dys, dz_k = jax.lax.fori_loop(0, (n + pad) // br, block, init)
    dz = jnp.zeros(z.shape, f32).at[:, :kc].set(dz_k)
    zeros = jnp.zeros_like
    return (
        zeros(q),
        zeros(k),
        zeros(v),
        zeros(out),
        zeros(lse),
        dys[:n].astype(ys.dtype),
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
    lse: jax.Array,
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
    ``out`` and ``lse`` are that attention's output and rows' log-normalisers
    (``edge_attention(..., return_lse=True)``).

    Returns ``(out + absent_pair_term(...), count)``: the output (unchanged in value),
    whose backward pass adds the probes' estimate of the absent pairs' gains, and the
    edge count (the number of edges in value) whose cotangent reaches every real pair
    through :func:`expected_pair_sum` instead of the sampled edges only. ``key`` draws
    the probes (:func:`probe_columns`).
    """
    n, m = q.shape[0], k.shape[0]
    cols, weight = probe_columns(key, k_mask, n, probes)
    sg = jax.lax.stop_gradient
    out = out + absent_pair_term(
        q, k, v, sg(out), sg(lse), ys, z, keys, cols, weight, q_mask, k_mask
    )
    expected = expected_pair_sum(ys, z, q_mask, k_mask)
    num = jax.lax.stop_gradient(jnp.sum(keys != n * m).astype(jnp.float32))
    return out, num + expected - jax.lax.stop_gradient(expected)
