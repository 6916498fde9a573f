"""Straight-through estimators for the sampled mask (paper eq. 9 and the released code),
and eq. 9's estimator of ``p_e`` on an edge list whose backward pass is two SpMMs
(:func:`edge_probs_straight_through`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbm_jax._loops import shared_trip_count
from sbm_jax._scopes import STE_BACKWARD, scoped
from sbm_jax._varying import vary_like

#: The estimators of ``SBMAttention(ste=...)``: ``"paper"`` (eq. 9, the mask scales the
#: logit), ``"reference"`` (the authors' released code: the mask multiplies the
#: post-softmax weights, rows are renormalised, the cotangent is clipped to [-1, 1]) and
#: ``"pairs"`` (ours, not in the paper: every real pair, sampled or not, gets the
#: first-order change of the loss when flipped; :mod:`sbm_jax.kernels.dense` on the
#: dense path, :mod:`sbm_jax.kernels.pairs` with probe keys on an edge list).
STE_MODES = ("paper", "reference", "pairs")


def check_ste(ste: str, field: str = "ste") -> None:
    """Raise a ValueError naming ``field`` unless ``ste`` is one of :data:`STE_MODES`."""
    if ste not in STE_MODES:
        raise ValueError(f"{field}={ste!r} is not an estimator; choose one of {STE_MODES}")


def straight_through(p: jax.Array) -> jax.Array:
    """Ones in the forward pass; the incoming gradient goes to ``p`` unchanged.

    Used as ``edge_scale=straight_through(p_e)`` on sampled edges, the score of edge
    ``e`` is ``1 * s_e`` in the forward pass while ``dL/dp_e = dL/da_e * s_e``
    (paper eq. 9), where ``a_e = M_e * s_e``.

    Written as ``1 + (p - stop_gradient(p))`` (exactly 1 for finite ``p``) rather than
    as a ``custom_vjp`` returning a constant: under ``vmap`` such a constant output is
    unbatched, so its cotangent arrives summed over the mapped axis and every example
    and head would receive the sum of all their gradients. This form stays batched
    like ``p``.
    """
    return 1.0 + (p - jax.lax.stop_gradient(p))


@jax.custom_vjp
def clip_cotangent(x: jax.Array) -> jax.Array:
    """Identity in the forward pass; the backward pass clips the cotangent to [-1, 1].

    ``clip_cotangent(straight_through(p))`` is the released code's estimator of the
    mask ``M`` (``torch`` ``hardtanh(M * dL/dM)`` with ``M = 1`` on a sampled edge): the
    total cotangent of ``M`` on the edge (attention and density terms together) is
    clipped before it reaches ``p``. The output is ``x`` itself, so under ``vmap`` it is
    batched like ``x`` and every mapped graph keeps its own cotangent.
    """
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -1.0, 1.0),)


clip_cotangent.defvjp(_clip_fwd, _clip_bwd)


def mask_estimator(p: jax.Array, ste: str) -> jax.Array:
    """``M_ste``: 1 in the forward pass, the estimator ``ste`` of the mask backward.

    ``"paper"``: ``straight_through(p)`` (eq. 9); ``"reference"``: the same with its
    cotangent clipped to [-1, 1] (:func:`clip_cotangent`). Edge logits are then
    ``s_e * M_ste`` (paper) or ``s_e + (M_ste - 1)`` (reference, i.e. ``s_e + log M``
    with the derivative ``d logit / dM = 1`` of a mask on the post-softmax weights), see
    :func:`edge_logit_terms`.
    """
    check_ste(ste)
    m = straight_through(p)
    return clip_cotangent(m) if ste == "reference" else m


def edge_logit_terms(m_ste: jax.Array, ste: str) -> dict[str, jax.Array]:
    """Keyword arguments of the edge kernels that put ``M_ste`` on the logits.

    ``"paper"``: ``{"edge_scale": M}`` (logit ``s_e * M_e``, eq. 9: ``dL/dM = dL/da * s``);
    ``"reference"`` and ``"pairs"``: ``{"edge_bias": M - 1}`` (logit ``s_e + M_e - 1``:
    the softmax masked by ``M`` after it and renormalised, ``dL/dM = dL/da``; the pairs
    estimator adds the absent pairs with :func:`sbm_jax.kernels.pairs.with_absent_pairs`).
    """
    check_ste(ste)
    if ste == "paper":
        return {"edge_scale": m_ste}
    return {"edge_bias": m_ste - 1.0}


#: Slots per chunk of the straight-through estimator's backward pass on CPU (two
#: ``[chunk, k]`` gathers and scatter-adds): 1024 keeps them in a CPU's L2. Accelerators,
#: where each loop step costs kernel launches, take :data:`STE_CHUNK_ACCELERATOR`.
STE_CHUNK = 1024
#: The same off the CPU: the sampler's chunk (:data:`sbm_jax.fastrg.EDGE_PROB_CHUNK`).
STE_CHUNK_ACCELERATOR = 4096


def _ste_chunk() -> int:
    return STE_CHUNK if jax.default_backend() == "cpu" else STE_CHUNK_ACCELERATOR


@jax.custom_vjp
def edge_probs_straight_through(
    ys: jax.Array, z: jax.Array, rows: jax.Array, cols: jax.Array, valid: jax.Array
) -> jax.Array:
    """The straight-through estimator of ``p_e`` on the edges, without computing ``p_e``.

    Args:
      ys: ``[n, k]`` ``Y S`` (:attr:`sbm_jax.fastrg.SamplingPlan.ys`).
      z: ``[m, K]`` key memberships, ``K >= k`` (:attr:`sbm_jax.fastrg.SamplingPlan.z`;
        the columns past ``k``, the exploration cluster, get no gradient).
      rows, cols, valid: ``[C]`` the edge list (one graph; under ``vmap`` they carry the
        same batch axes as ``ys`` and ``z``).

    Returns:
      ``[C]`` float32: 1 on valid slots, 0 on empty ones. Its gradient is that of
      ``where(valid, p_e, 0)`` with ``p_e = ys[row] . z[col, :k]`` (paper eq. 9: the
      cotangent of the estimator goes to ``p_e`` unchanged).

    The forward pass never needs ``p_e`` (the estimator is 1), so it costs O(C). The
    backward pass receives the cotangent ``g`` on the edges (a sparse ``[n, m]`` matrix
    ``G``) and returns ``dys = G Z[:, :k]`` and ``dz[:, :k] = G^T ys``: two SpMMs with
    ``k`` columns, streamed in chunks of :data:`STE_CHUNK` slots (CPU), instead of the
    ``[C, k]`` gathered tensors that autodiff of :func:`sbm_jax.fastrg.edge_probs` keeps.
    """
    del rows, cols
    return _ste_ones(ys, z, valid)


def _ste_ones(ys, z, valid):
    # 1 on valid slots. The output depends on ``valid`` *and* on ``ys`` and ``z`` (times
    # zero), so that under vmap it is batched whenever any of them is: a constant, or an
    # output batched only like a shared edge list, would be unbatched while the graphs
    # are not, and its cotangent would arrive summed over the mapped axis (every graph
    # getting all graphs' gradients).
    t = jax.lax.stop_gradient(ys[0, 0] + z[0, 0]).astype(jnp.float32)
    zero = jnp.where(jnp.isfinite(t), 0.0 * t, 0.0)  # exactly 0, even for a NaN input
    return valid.astype(jnp.float32) + zero


def _probs_ste_fwd(ys, z, rows, cols, valid):
    return _ste_ones(ys, z, valid), (ys, z, rows, cols, valid)


@scoped(STE_BACKWARD)
def _probs_ste_bwd(res, g):
    ys, z, rows, cols, valid = res
    n, k = ys.shape
    m, kz = z.shape
    zk = jnp.asarray(z)[:, :k].astype(jnp.float32)
    ys32 = jnp.asarray(ys, jnp.float32)
    g = jnp.where(valid, g, 0.0).astype(jnp.float32)
    size = rows.shape[0]
    chunk = min(_ste_chunk(), size)
    pad = -size % chunk
    # Padding slots point at row n - 1 (rows stay sorted) / column 0 with a zero
    # cotangent: they add nothing.
    rows = jnp.pad(rows, (0, pad), constant_values=n - 1)
    cols, g = (jnp.pad(a, (0, pad)) for a in (cols, g))
    # Only the chunks up to the last valid slot hold edges (valid slots come first in the
    # sampler's layout, but any layout is handled): the loop stops there, so the work
    # follows the edges, not the capacity. Under vmap it stops at the largest over the
    # graphs: a graph's chunks past its own last edge have zero cotangents.
    last = jnp.max(jnp.where(jnp.pad(valid, (0, pad)), jnp.arange(size + pad), -1))
    live_chunks = shared_trip_count((last + chunk) // chunk)

    def step(i, carry):
        dys, dz = carry
        r, c, gg = (jax.lax.dynamic_slice(a, (i * chunk,), (chunk,)) for a in (rows, cols, g))
        dys = dys.at[r].add(
            gg[:, None] * zk.at[c].get(mode="promise_in_bounds"),
            indices_are_sorted=True,
            mode="promise_in_bounds",
        )
        dz = dz.at[c].add(
            gg[:, None] * ys32.at[r].get(mode="promise_in_bounds"), mode="promise_in_bounds"
        )
        return dys, dz

    init = (jnp.zeros((n, k), jnp.float32), jnp.zeros((m, k), jnp.float32))
    init = vary_like(init, ys32, zk, rows, cols, g)
    dys, dzk = jax.lax.fori_loop(0, live_chunks, step, init)
    dz = jnp.pad(dzk, ((0, 0), (0, kz - k)))
    return dys.astype(ys.dtype), dz.astype(z.dtype), None, None, None


edge_probs_straight_through.defvjp(_probs_ste_fwd, _probs_ste_bwd)
