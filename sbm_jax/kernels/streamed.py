"""The SBM layer's streamed sparse path: one graph drawn and attended block by block.

The bucketed sparse path (:func:`sbm_jax.attention.sbm.sbm_attention_core` with
``impl="sparse"``) samples a whole graph into one static buffer and keeps its edge keys
for the backward pass, so its compiled step reserves the largest capacity bucket's
slots whatever the batch draws. Here the queries of one (example, head) are walked in
blocks of ``bq`` rows (``lax.map``), and each block

* takes its rows' Poisson draw counts (drawn for the whole graph up front, as the
  bucketed path draws them, :func:`~sbm_jax.fastrg.draw_row_counts`);
* picks the smallest of a few small static buffers (``capacities``: fractions of the
  block's ``bq * m`` pairs) that holds its draws (``lax.switch``), or, when none does
  (or the graph's bernoulli bound is too close to 1), the dense path for its rows alone
  (:func:`~sbm_jax.kernels.dense.streamed_sbm_attention` with the block's row offset:
  the same law, pair by pair);
* draws its edges with fastRG from the graph's key folded with the block index
  (:func:`~sbm_jax.fastrg.sample_edge_keys` on the block's rows of the plan, against
  the whole key side: fastRG is row-wise, so the block's draws are exactly those rows'
  draws), attends over them with the ``rows`` kernel, and adds the estimator of the
  mask (``ste``) on its edges.

Every branch is a ``jax.checkpoint`` that keeps only the kernels' output and
log-normaliser (:data:`~sbm_jax.kernels.rows.EDGE_KERNEL_RESIDUAL_NAMES`): in the
backward pass each block draws the same edges again from the same keys (as flash
attention regenerates its dropout mask, and as the dense path regenerates its mask)
instead of storing them. So the temporaries are one block's buffer at a time, and what
the step keeps per graph is ``O(n d)``: memory follows neither the capacity of a
whole-graph bucket nor the draws. The price is a second draw of every block in the
backward pass.

The same law as the bucketed path, block by block (the draws of a row do not depend on
the other rows), and the same estimators; an edge is lost only when the dense fallback
is ruled out (``dense=False``, the layer's ``max_dense_elements``), and then the
``overflow`` flag says so. Plain ``jax.numpy`` / ``lax``: runs on every backend; a
fused GPU kernel maps each block to a query tile (docs/architecture.md).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sbm_jax.fastrg import (
    SEARCH_WINDOW,
    SamplingPlan,
    edges_from_keys,
    padded_cdf,
    sample_edge_keys,
    with_tables,
)
from sbm_jax.kernels.dense import default_block_rows, streamed_sbm_attention
from sbm_jax.kernels.pairs import with_absent_pairs
from sbm_jax.kernels.rows import rows_edge_attention
from sbm_jax.ste import clip_cotangent, edge_logit_terms, edge_probs_straight_through

#: Pairs ``bq * m`` of one streamed block that :func:`default_stream_rows` aims at.
STREAM_TILE_ELEMENTS = 2**20

# Salts folded into a block's key: its dense fallback and its pair probes draw from keys
# of their own, apart from the four fastRG splits of the block key.
_PROBE_SALT = 1
_DENSE_SALT = 2


class StreamConfig(NamedTuple):
    """Static settings of :func:`streamed_graph_attention`."""

    block_rows: int  # bq
    capacities: tuple[int, ...]  # per-block sparse buffers (slots), increasing
    dense: bool  # a block above the largest buffer runs dense (else its extra draws are lost)
    law: str
    ste: str
    forced_half: int  # forced edges |i - j| <= forced_half; -1 for none
    dropout_rate: float
    pair_probes: int
    thin_budget: float | None


def default_stream_rows(n: int, m: int, tile_elements: int = STREAM_TILE_ELEMENTS) -> int:
    """``bq``: a power of two with ``bq * m`` near ``tile_elements``, at least 8 and at most
    ``n`` rounded up to a power of two."""
    want = max(1, tile_elements // max(1, m))
    bq = 2 ** max(0, math.floor(math.log2(want)))
    cap = 2 ** math.ceil(math.log2(max(1, n)))
    return int(min(max(8, bq), cap))


def block_capacities(fractions, block_rows: int, m: int) -> tuple[int, ...]:
    """Static per-block buffers ``ceil(f * bq * m)`` for each fraction ``f``."""
    return tuple(max(1, math.ceil(f * block_rows * m)) for f in fractions)


def forced_block_keys(
    q_mask_b: jax.Array, k_mask: jax.Array, row_offset: jax.Array, half: int
) -> jax.Array:
    """Keys ``local_row * m + col`` of the forced pairs ``|i - j| <= half`` (real tokens)
    of a block of query rows starting at position ``row_offset``; ``bq * m`` for none."""
    bq, m = q_mask_b.shape[0], k_mask.shape[0]
    offsets = jnp.arange(-half, half + 1)
    local = jnp.arange(bq)[:, None]
    j = row_offset + local + offsets[None, :]
    ok = (j >= 0) & (j < m) & q_mask_b[:, None] & k_mask[jnp.clip(j, 0, m - 1)]
    return jnp.where(ok, local * m + j, bq * m).reshape(-1).astype(jnp.int32)


def _pad_rows(a: jax.Array, n_pad: int, value=0) -> jax.Array:
    widths = ((0, n_pad - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)
    return jnp.pad(a, widths, constant_values=value)


def block_edge_keys(
    cfg: StreamConfig,
    key: jax.Array,
    plan: SamplingPlan,
    x: dict,
    capacity: int,
    padded_key_cdf: jax.Array | None = None,
) -> jax.Array:
    """Block ``x["b"]``'s sorted edge keys ``local_row * m + col`` (fastRG on its rows)."""
    bq = cfg.block_rows
    b = x["b"]
    plan_b = plan.replace(
        y=x["y"],
        ys=x["ys"],
        row_cdf=x["row_cdf"],
        row_guide=x["row_guide"],
        row_rate=x["row_rate"],
        oversample=x["oversample"],
        q_mask=x["q_mask"],
    )
    forced = None
    if cfg.forced_half >= 0:
        forced = forced_block_keys(x["q_mask"], plan.k_mask, b * bq, cfg.forced_half)
    return sample_edge_keys(
        jax.random.fold_in(key, b),
        plan_b,
        x["counts"],
        capacity=capacity,
        law=cfg.law,
        forced_keys=forced,
        thin_budget=cfg.thin_budget,
        padded_key_cdf=padded_key_cdf,
    )


def _blocked_inputs(cfg: StreamConfig, plan: SamplingPlan, row_counts, q) -> dict:
    n, bq = q.shape[0], cfg.block_rows
    n_pad = -(-n // bq) * bq
    fields = {
        "q": q,
        "y": plan.y,
        "ys": plan.ys,
        "row_cdf": plan.row_cdf,
        "row_guide": plan.row_guide,
        "row_rate": plan.row_rate,
        "q_mask": plan.q_mask,
        "counts": row_counts.astype(jnp.int32),
    }
    xs = {name: _pad_rows(a, n_pad) for name, a in fields.items()}
    xs["oversample"] = _pad_rows(plan.oversample, n_pad, 1.0)
    xs = {name: a.reshape(n_pad // bq, bq, *a.shape[1:]) for name, a in xs.items()}
    xs["b"] = jnp.arange(n_pad // bq, dtype=jnp.int32)
    return xs


def streamed_graph_attention(
    cfg: StreamConfig,
    key: jax.Array,
    drop_key: jax.Array,
    plan: SamplingPlan,
    row_counts: jax.Array,
    force_dense: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One (example, head): ``(out [n, dv], count [], edges [], overflow [], path [])``.

    ``plan``: the graph's :class:`~sbm_jax.fastrg.SamplingPlan` (its tables are built
    here, in each pass, when missing); ``row_counts [n]``: the rows' Poisson draw counts;
    ``force_dense`` (``[]`` bool): every block runs dense (the bernoulli bound is too
    close to 1 for oversampling). ``count`` is the edge count whose cotangent carries the
    density term (its value is the number of edges), ``edges`` the same as an int,
    ``overflow`` whether draws were lost (only with ``cfg.dense=False``) and ``path`` the
    largest buffer index a block used (``len(cfg.capacities)``: some block ran dense).
    Gradients reach ``q``, ``k``, ``v``, ``plan.ys`` and ``plan.z``.
    """
    sg = jax.lax.stop_gradient
    rest = (key, drop_key, jax.tree.map(sg, plan), row_counts, force_dense)
    return _stream(cfg, q, k, v, plan.ys, plan.z, rest)


def _setup(cfg: StreamConfig, q, k, v, ys, z, rest):
    """The blocked inputs and ``block(x, q_b, ys_b, k, v, z)``, one block's outputs."""
    key, drop_key, plan, row_counts, force_dense = rest
    m = k.shape[0]
    bq = cfg.block_rows
    kc = ys.shape[1]
    plan = with_tables(plan.replace(ys=ys, z=z))
    # The [K, m] key CDF padded once per graph, not once per block.
    padded_key_cdf = padded_cdf(plan.zcdf, SEARCH_WINDOW)  # type: ignore[arg-type]
    xs = _blocked_inputs(cfg, plan, row_counts, q)
    rate = cfg.dropout_rate
    pairs = cfg.ste == "pairs"

    def drop_rng(b):
        return jax.random.fold_in(drop_key, b) if rate > 0.0 else None

    def block(x, q_b, ys_b, k, v, z):
        x = dict(x, q=q_b, ys=ys_b)
        zk = z[:, :kc]

        def sparse(capacity):
            def run(x):
                keys = block_edge_keys(cfg, key, plan, x, capacity, padded_key_cdf)
                edges = edges_from_keys(keys, bq, m)
                m_ste = edge_probs_straight_through(x["ys"], z, edges.rows, edges.cols, edges.valid)
                if cfg.ste == "reference":
                    m_ste = clip_cotangent(m_ste)
                out = rows_edge_attention(
                    x["q"],
                    k,
                    v,
                    edges,
                    **edge_logit_terms(m_ste, cfg.ste),
                    dropout_rate=rate,
                    dropout_rng=drop_rng(x["b"]),
                    return_lse=pairs,
                )
                if pairs:
                    out, lse = out
                    probe_key = jax.random.fold_in(jax.random.fold_in(key, x["b"]), _PROBE_SALT)
                    out, num = with_absent_pairs(
                        probe_key, x["q"], k, v, out, lse, x["ys"], z, keys,
                        x["q_mask"], plan.k_mask, probes=cfg.pair_probes,
                    )  # fmt: skip
                else:
                    num = jnp.sum(jnp.where(edges.valid, m_ste, 0.0))
                lost = jnp.sum(x["counts"]) > capacity
                return out.astype(v.dtype), num, edges.num_edges, lost

            return run

        def dense(x):
            b = x["b"]
            out, num = streamed_sbm_attention(
                jax.random.fold_in(jax.random.fold_in(key, b), _DENSE_SALT),
                x["q"],
                k,
                v,
                x["ys"],
                zk,
                x["q_mask"],
                plan.k_mask,
                plan.delta,
                law=cfg.law,
                ste=cfg.ste,
                forced_half=None if cfg.forced_half < 0 else cfg.forced_half,
                dropout_rate=rate,
                dropout_rng=drop_rng(b),
                block_rows=default_block_rows(bq, m),
                row_offset=b * bq,
            )
            edges = jax.lax.stop_gradient(num).astype(jnp.int32)
            return out.astype(v.dtype), num, edges, jnp.asarray(False)

        branches = [sparse(c) for c in cfg.capacities]
        if cfg.dense or not branches:
            branches.append(dense)
        caps = jnp.asarray(cfg.capacities or (0,), jnp.int32)
        total = jnp.sum(x["counts"])
        choice = jnp.sum(caps[: len(cfg.capacities)] < total).astype(jnp.int32)
        if cfg.dense or not cfg.capacities:
            choice = jnp.where(force_dense, len(cfg.capacities), choice)
        choice = jnp.minimum(choice, len(branches) - 1)
        out, num, edges, lost = jax.lax.switch(choice, branches, x)
        return out, num, edges, lost, choice

    return xs, block


def _stream_forward(cfg, q, k, v, ys, z, rest):
    n = q.shape[0]
    xs, block = _setup(cfg, q, k, v, ys, z, rest)
    out, num, edges, lost, choice = jax.lax.map(lambda x: block(x, x["q"], x["ys"], k, v, z), xs)
    out = out.reshape(-1, out.shape[-1])[:n]
    return out, jnp.sum(num), jnp.sum(edges), jnp.any(lost), jnp.max(choice)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stream(cfg, q, k, v, ys, z, rest):
    return _stream_forward(cfg, q, k, v, ys, z, rest)


def _stream_fwd(cfg, q, k, v, ys, z, rest):
    # Nothing edge-sized is kept: the backward pass draws every block again.
    return _stream_forward(cfg, q, k, v, ys, z, rest), (q, k, v, ys, z, rest)


def _stream_bwd(cfg, res, cts):
    q, k, v, ys, z, rest = res
    dout, dnum = cts[0], cts[1]
    n, bq = q.shape[0], cfg.block_rows
    n_pad = -(-n // bq) * bq
    xs, block = _setup(cfg, q, k, v, ys, z, rest)
    dout = _pad_rows(dout.astype(v.dtype), n_pad).reshape(n_pad // bq, bq, -1)
    dnum = jnp.asarray(dnum, jnp.float32)

    def step(carry, inp):
        x, do_b = inp

        def f(q_b, ys_b, k, v, z):
            out, num, *_ = block(x, q_b, ys_b, k, v, z)
            return out, num

        _, vjp = jax.vjp(f, x["q"], x["ys"], k, v, z)
        dq_b, dys_b, dk_b, dv_b, dz_b = vjp((do_b, dnum))
        dk, dv, dz = carry
        return (dk + dk_b, dv + dv_b, dz + dz_b), (dq_b, dys_b)

    init = (jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(z))
    (dk, dv, dz), (dq, dys) = jax.lax.scan(step, init, (xs, dout))
    dq = dq.reshape(n_pad, -1)[:n]
    dys = dys.reshape(n_pad, -1)[:n]
    return dq, dk, dv, dys, dz, None


_stream.defvjp(_stream_fwd, _stream_bwd)


def streamed_graphs(cfg: StreamConfig):
    """:func:`streamed_graph_attention` with ``cfg`` bound (a ``custom_vjp`` inside: its
    backward pass draws every block again, so nothing edge-sized is stacked over the
    blocks or the graphs)."""
    return partial(streamed_graph_attention, cfg)
