"""Attention on an edge list: gather-dot scores, segment softmax, segment-sum aggregation.

This is the canonical, portable implementation; faster layouts sit behind the same
functions and are tested against :func:`dense_masked_attention`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sbm_jax.graph import EdgeList

# The kernels sit below this module (they never import it): ``impl`` dispatches to them.
from sbm_jax.kernels import EDGE_KERNEL_RESIDUAL_NAMES, KERNELS

__all__ = [
    "EDGE_KERNEL_RESIDUAL_NAMES",
    "dense_masked_attention",
    "edge_attention",
    "edge_scores",
    "edge_softmax",
]


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2:
        raise ValueError(
            f"expected q [n, d], k [m, d], v [m, dv]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v lengths differ: k {k.shape}, v {v.shape}")


def edge_scores(q: jax.Array, k: jax.Array, edges: EdgeList) -> jax.Array:
    """``[C]`` float32 scaled dot products ``q_row . k_col / sqrt(d)`` (0 in empty slots).

    Scores and the softmax statistics are float32 whatever the input dtype (bf16 inputs
    keep float32 softmax statistics)."""
    edges.check_operands(q.shape[0], k.shape[0])
    f32 = jnp.float32
    s = jnp.sum(q[edges.rows].astype(f32) * k[edges.cols].astype(f32), axis=-1)
    s = s / math.sqrt(q.shape[-1])
    return jnp.where(edges.valid, s, 0.0)


def edge_softmax(scores: jax.Array, edges: EdgeList, num_rows: int) -> jax.Array:
    """Softmax over the valid edges of each row; ``[C]`` weights, 0 in empty slots."""
    return _edge_softmax_lse(scores, edges, num_rows)[0]


def _edge_softmax_lse(
    scores: jax.Array, edges: EdgeList, num_rows: int
) -> tuple[jax.Array, jax.Array]:
    """:func:`edge_softmax` and each row's log-normaliser ``[num_rows]`` (0 without edges)."""
    rows = edges.rows
    masked = jnp.where(edges.valid, scores, -jnp.inf)
    row_max = jax.ops.segment_max(masked, rows, num_segments=num_rows, indices_are_sorted=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.where(edges.valid, jnp.exp(scores - row_max[rows]), 0.0)
    denom = jax.ops.segment_sum(e, rows, num_segments=num_rows, indices_are_sorted=True)
    has = denom > 0
    safe = jnp.where(has, denom, 1.0)
    lse = jnp.where(has, row_max + jnp.log(safe), 0.0)
    return e / safe[rows], lse


def edge_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    edges: EdgeList,
    *,
    edge_scale: jax.Array | None = None,
    edge_bias: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    impl: str = "segment",
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax attention restricted to the edges of ``edges``.

    Args:
      q: ``[n, d]`` queries; k: ``[m, d]`` keys; v: ``[m, dv]`` values.
      edges: the graph; rows index ``q``, columns index ``k``.
      edge_scale: optional ``[C]`` factor on each edge's score (the STE of the sampled
        mask: ``straight_through(edges.probs)``, paper eq. 9).
      edge_bias: optional ``[C]`` term added to each edge's logit after the scale (the
        released code's estimator: ``mask_estimator(p, "reference") - 1``, zero in the
        forward pass; see :func:`sbm_jax.ste.edge_logit_terms`).
      dropout_rate, dropout_rng: attention dropout on the normalised edge weights.
      impl: ``"segment"``, the canonical gather + segment-op implementation (the
        reference every faster kernel is tested against), or a kernel of
        :data:`sbm_jax.kernels.KERNELS`: ``"rows"`` streams virtual rows of the
        row-sorted edge list with a flash-style backward (needs the EdgeList layout
        contract: valid edges first, sorted by row); ``"triton"`` runs the same virtual
        rows as a Pallas kernel on an NVIDIA GPU (:mod:`sbm_jax.kernels.triton`).
      return_lse: also return each row's log-normaliser ``lse [n]`` float32 (of the
        logits before dropout; 0 for a row without edges), as the kernel keeps it for its
        backward pass. It carries no gradient (``stop_gradient``).

    Returns:
      ``[n, dv]``, or ``(out, lse)`` with ``return_lse``; a row with no valid edge is
      exactly 0. Empty slots contribute nothing and receive zero gradient.
    """
    _check_qkv(q, k, v)
    edges.check_operands(q.shape[0], k.shape[0], edge_scale=edge_scale, edge_bias=edge_bias)
    if impl != "segment":
        if impl not in KERNELS:
            choices = ("segment", *KERNELS)
            raise ValueError(f"edge_attention impl={impl!r} is unknown; choose one of {choices}")
        return KERNELS[impl](
            q,
            k,
            v,
            edges,
            edge_scale=edge_scale,
            edge_bias=edge_bias,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            return_lse=return_lse,
        )
    n = q.shape[0]
    s = edge_scores(q, k, edges)
    if edge_scale is not None:
        s = s * jnp.where(edges.valid, edge_scale, 0.0)
    if edge_bias is not None:
        s = s + jnp.where(edges.valid, edge_bias, 0.0)
    w, lse = _edge_softmax_lse(s, edges, n)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, w.shape)
        w = jnp.where(keep, w / (1.0 - dropout_rate), 0.0)
    contrib = w[:, None] * v[edges.cols].astype(jnp.float32)  # accumulate in float32
    out = jax.ops.segment_sum(contrib, edges.rows, num_segments=n, indices_are_sorted=True)
    out = out.astype(v.dtype)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


def dense_masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Dense reference: softmax of ``q k^T / sqrt(d)`` (times ``scale``, plus ``bias``)
    over ``mask``.

    ``mask`` is ``[n, m]`` bool; ``scale`` an optional ``[n, m]`` factor on the scores,
    ``bias`` an optional ``[n, m]`` term added to them. A row with no allowed key outputs
    exactly 0. Materialises ``[n, m]`` arrays: a reference, not the layer's dense path
    (:mod:`sbm_jax.kernels.dense` streams it).
    """
    _check_qkv(q, k, v)
    if mask.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"mask must be [{q.shape[0]}, {k.shape[0]}], got {mask.shape}")
    s = jnp.einsum("nd,md->nm", q, k, preferred_element_type=jnp.float32)
    s = s / math.sqrt(q.shape[-1])  # float32 scores and softmax statistics
    if scale is not None:
        s = s * jnp.where(mask, scale, 0.0)
    if bias is not None:
        s = s + jnp.where(mask, bias, 0.0)
    masked = jnp.where(mask, s, -jnp.inf)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - row_max), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    w = e / jnp.where(denom > 0, denom, 1.0)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, w.shape)
        w = jnp.where(keep, w / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("nm,md->nd", w, v.astype(jnp.float32))
    return out.astype(v.dtype)
