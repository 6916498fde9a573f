"""Edge attention on virtual rows, streamed in blocks, with a flash-style backward.

The sampler's :class:`~sbm_jax.graph.EdgeList` is row-sorted (CSR order), so the edges
of query ``i`` are one contiguous run of slots. This kernel cuts every run into
*virtual rows* of at most ``R`` consecutive slots (``R`` static) and processes the
virtual rows in blocks of ``Vb`` (``Vb * R`` slots, ~2^15), so that no temporary is
larger than one block:

* forward (``lax.map`` over blocks): per virtual row, gather the ``R`` key/value
  vectors, broadcast the single query vector (never gathered per edge), and reduce along
  the slot axis to a local max ``mx``, local normaliser ``l`` and unnormalised output
  ``o`` (dense reductions, no segment op over edges). The virtual rows of each query are
  then merged with one segment max / sum over the ``V ~ n + C/R`` virtual rows (not over
  the ``C`` edges), as flash attention merges its key blocks.
* backward (``jax.custom_vjp``, ``lax.scan`` over blocks): only the output and the
  per-query log-normaliser ``lse`` are kept from the forward. Scores are recomputed per
  block; ``D_i = dOut_i . out_i`` gives the softmax Jacobian, so
  ``da_e = w_e (dOut_i . v_j z_e - D_i)``; dQ is a dense reduction per virtual row, and
  dK, dV are scatter-adds of a block into ``[m, d]`` accumulators carried by the scan.

Virtual rows are found without touching the edges: ``rowptr = searchsorted(rows, i)``
gives each query's run, and each virtual row is a ``(query, first slot, length)``
triple, so the layout costs O(n log C + V), not a pass over the slots. Static cost is
``V * R <= n * R + C`` slot visits; every query owns at least one virtual row
(so a block's queries are consecutive) and their number is bounded by
``n + ceil(C / R)`` whatever the degrees, so the kernel is exact for every graph (no
overflow, no fallback).

Everything is plain ``jax.numpy`` / ``lax``: it runs on CPU, GPU and TPU alike.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sbm_jax._loops import shared_trip_count
from sbm_jax._random import bernoulli
from sbm_jax._scopes import EDGE_KERNEL, scoped
from sbm_jax._varying import vary_like
from sbm_jax.graph import EdgeList

#: ``jax.ad_checkpoint.checkpoint_name`` tags that the fast kernels put on the values
#: their backward pass needs from the forward (output and per-row log-normaliser). A
#: caller that wraps a kernel in ``jax.checkpoint`` can keep them with
#: ``jax.checkpoint_policies.save_only_these_names(*EDGE_KERNEL_RESIDUAL_NAMES)`` so
#: that the attention forward is not run again in the backward pass. Defined here, below
#: :mod:`sbm_jax.edge_ops` (which re-exports it), so that the kernels never import it.
EDGE_KERNEL_RESIDUAL_NAMES = ("edge_attention_out", "edge_attention_lse")

#: Most slots per block (``Vb * R``): a block's gathered keys or values, ``[Vb, R, d]``
#: float32, are 2 MiB at ``d = 32``.
DEFAULT_BLOCK_SLOTS = 2**14
#: A block holds at most this share of the edge list's slots (and at least
#: :data:`MIN_BLOCK_SLOTS`): see :func:`default_block_slots`.
BLOCKS_PER_LIST = 8
MIN_BLOCK_SLOTS = 2**10


class RowBlocks(NamedTuple):
    """Virtual-row view of an EdgeList: ``V`` virtual rows of at most ``R`` slots.

    ``V`` is a multiple of the block size. All arrays are ``[V] int32``.
    """

    row: jax.Array  # query index of each virtual row (n - 1 for unused ones)
    start: jax.Array  # first slot of the virtual row in the EdgeList
    length: jax.Array  # number of valid slots in it, in [0, R]; 0 for unused ones


class _Config(NamedTuple):
    slots_per_row: int  # R
    block_rows: int  # Vb
    has_scale: bool
    has_bias: bool
    has_dropout: bool


def default_slots_per_row(capacity: int, num_rows: int) -> int:
    """``R``: a power of two near a quarter of the mean slots per query, in [8, 64].

    Padding costs up to ``n * R`` slot visits, the per-virtual-row work about
    ``(n + C/R) * d``; a quarter of the mean degree balanced the two in measurements
    on CPU.
    """
    mean = capacity / max(1, num_rows)
    r = 2 ** max(0, round(math.log2(max(1.0, mean / 4))))
    return int(min(64, max(8, r)))


def default_block_slots(capacity: int) -> int:
    """Slots per streamed block for an edge list of ``capacity`` slots:
    ``capacity / 8``, clipped to ``[MIN_BLOCK_SLOTS, DEFAULT_BLOCK_SLOTS]``.

    Large lists get :data:`DEFAULT_BLOCK_SLOTS`. On a small list the block temporaries
    (several live at once in the backward) are a large share of the whole layer's
    memory, so the block shrinks with the list.
    """
    share = capacity // BLOCKS_PER_LIST
    return int(min(DEFAULT_BLOCK_SLOTS, max(MIN_BLOCK_SLOTS, share)))


def _num_virtual(capacity: int, num_rows: int, r: int, block_rows: int) -> int:
    # sum_i max(1, ceil(deg_i / R)) <= n + C / R, rounded up to whole blocks.
    bound = num_rows + -(-capacity // r)
    return -(-bound // block_rows) * block_rows


def row_blocks(edges: EdgeList, num_rows: int, *, slots_per_row: int, block_rows: int) -> RowBlocks:
    """Cut the row-sorted runs of ``edges`` into virtual rows of ``slots_per_row`` slots.

    Relies on the EdgeList layout contract: valid edges first, sorted by row.
    Costs O(n log C + V); no gradient flows through it.
    """
    n, r = num_rows, slots_per_row
    cap = edges.capacity
    num_virtual = _num_virtual(cap, n, r, block_rows)
    keyed = jnp.where(edges.valid, edges.rows, n).astype(jnp.int32)  # sorted, n = empty
    rowptr = jnp.searchsorted(keyed, jnp.arange(n + 1, dtype=jnp.int32), side="left")
    rowptr = rowptr.astype(jnp.int32)
    deg = rowptr[1:] - rowptr[:-1]  # [n]
    # Every query gets at least one virtual row (an empty one has length 0), so the rows
    # a block touches are consecutive: at most Vb of them, from the block's first row.
    per_row = jnp.maximum((deg + r - 1) // r, 1)
    vend = jnp.cumsum(per_row).astype(jnp.int32)  # exclusive end of each row's virtual rows
    vidx = jnp.arange(num_virtual, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(vend, vidx, side="right"), n - 1).astype(jnp.int32)
    chunk = vidx - (vend[row] - per_row[row])
    live = vidx < vend[-1]
    start = jnp.where(live, rowptr[row] + chunk * r, 0).astype(jnp.int32)
    length = jnp.where(live, jnp.clip(deg[row] - chunk * r, 0, r), 0).astype(jnp.int32)
    row = jnp.where(live, row, n - 1)
    return RowBlocks(row=row, start=start, length=length)


def _blocked(a: jax.Array, vb: int) -> jax.Array:
    return a.reshape(-1, vb, *a.shape[1:])


def _slots(start, length, r):
    offs = jnp.arange(r, dtype=jnp.int32)
    ok = offs[None, :] < length[:, None]  # [Vb, R]
    slots = jnp.where(ok, start[:, None] + offs[None, :], 0)
    return slots, ok


def _scores(cfg, q, k, scale, bias, cols, row_b, start_b, len_b):
    """Per block: slots, mask, cols, raw scores s, logits a (all [Vb, R]).

    Scores, logits and everything downstream are float32 whatever the input dtype: the
    gathered queries and keys are upcast before the dot product (bf16 scores lost ~1e-2
    at unit scale)."""
    f32 = jnp.float32
    slots, ok = _slots(start_b, len_b, cfg.slots_per_row)
    c = cols.at[slots].get(mode="promise_in_bounds")
    qb = q.at[row_b].get(mode="promise_in_bounds").astype(f32)  # [Vb, d]
    kb = k.at[c].get(mode="promise_in_bounds").astype(f32)  # [Vb, R, d]
    s = jnp.einsum("vd,vrd->vr", qb, kb) * (1.0 / math.sqrt(q.shape[-1]))
    a = s * scale.at[slots].get(mode="promise_in_bounds") if cfg.has_scale else s
    if cfg.has_bias:
        a = a + bias.at[slots].get(mode="promise_in_bounds")
    return slots, ok, c, qb, kb, s, a


def _local_rows(row_b: jax.Array, vb: int):
    """Rows touched by a block are contiguous: ``first + [0, Vb)``; local ids of ``row_b``."""
    first = row_b[0]
    return first, row_b - first


def _live_blocks(blocks: RowBlocks, vb: int) -> jax.Array:
    """Number of leading blocks that hold a valid slot (the rest add nothing): the loops
    run over these only, so the work follows the sampled edges, not the capacity. Under
    ``vmap``, the largest over the graphs (:func:`~sbm_jax._loops.shared_trip_count`): a
    block past a graph's own live ones has only zero-length virtual rows, which change
    no carry."""
    vidx = jnp.arange(blocks.length.shape[0], dtype=jnp.int32)
    last = jnp.max(jnp.where(blocks.length > 0, vidx, -1))
    return shared_trip_count((last + vb) // vb)


def _for_blocks(blocks: RowBlocks, vb: int, body, init, reads=()):
    """``body(carry, (row_b, start_b, len_b))`` over the live blocks, in order.

    ``reads``: the arrays ``body`` reads besides the blocks; the initial carry is made
    to vary like them and the blocks inside ``jax.shard_map`` (see :mod:`sbm_jax._varying`).
    """
    init = vary_like(init, blocks, *reads)

    def step(i, carry):
        sl = lambda a: jax.lax.dynamic_slice(a, (i * vb,), (vb,))  # noqa: E731
        return body(carry, (sl(blocks.row), sl(blocks.start), sl(blocks.length)))

    return jax.lax.fori_loop(0, _live_blocks(blocks, vb), step, init)


def _forward(cfg, q, k, v, scale, bias, z, cols, blocks):
    n, dv = q.shape[0], v.shape[-1]
    vb = cfg.block_rows
    seg_max = partial(jax.ops.segment_max, num_segments=vb, indices_are_sorted=True)
    seg_sum = partial(jax.ops.segment_sum, num_segments=vb, indices_are_sorted=True)

    def block(carry, xs):
        # Online softmax over blocks; carries cover n + Vb rows so that the Vb-row window
        # starting at any query index fits without clamping.
        row_max, denom, acc = carry
        row_b, start_b, len_b = xs
        slots, ok, c, _, _, _, a = _scores(cfg, q, k, scale, bias, cols, row_b, start_b, len_b)
        a = jnp.where(ok, a, -jnp.inf)
        live = len_b > 0
        mx = jnp.where(live, jnp.max(a, axis=1), -jnp.inf)
        first, local = _local_rows(row_b, vb)
        old_max = jax.lax.dynamic_slice(row_max, (first,), (vb,))
        new_max = jnp.maximum(old_max, seg_max(mx, local))
        safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.where(ok, jnp.exp(a - safe[local][:, None]), 0.0)  # [Vb, R]
        lsum = jnp.sum(p, axis=1)
        if cfg.has_dropout:
            p = p * z.at[slots].get(mode="promise_in_bounds")
        vals = v.at[c].get(mode="promise_in_bounds").astype(jnp.float32)  # [Vb, R, dv]
        o = jnp.einsum("vr,vrd->vd", p, vals)  # float32 accumulation
        keep = jnp.exp(old_max - safe)  # 0 where old_max = -inf
        new_den = jax.lax.dynamic_slice(denom, (first,), (vb,)) * keep + seg_sum(lsum, local)
        old_acc = jax.lax.dynamic_slice(acc, (first, 0), (vb, dv))
        new_acc = old_acc * keep[:, None] + seg_sum(o, local)
        row_max = jax.lax.dynamic_update_slice(row_max, new_max, (first,))
        denom = jax.lax.dynamic_update_slice(denom, new_den, (first,))
        acc = jax.lax.dynamic_update_slice(acc, new_acc, (first, 0))
        return row_max, denom, acc

    init = (
        jnp.full((n + vb,), -jnp.inf, jnp.float32),
        jnp.zeros((n + vb,), jnp.float32),
        jnp.zeros((n + vb, dv), jnp.float32),
    )
    row_max, denom, acc = _for_blocks(blocks, vb, block, init, (q, k, v, scale, bias, z, cols))
    row_max, denom, acc = row_max[:n], denom[:n], acc[:n]
    has = denom > 0
    out = (acc / jnp.where(has, denom, 1.0)[:, None]).astype(v.dtype)
    lse = jnp.where(has, row_max + jnp.log(jnp.where(has, denom, 1.0)), 0.0)
    return out, lse


def _backward(cfg, q, k, v, scale, bias, z, cols, blocks, out, lse, dout):
    """Gradients in a loop over the live blocks: ``{"dq", "dk", "dv"}`` and, when the
    kernel has them, ``"dscale"`` and ``"dbias"`` (``[C]``)."""
    n, d = q.shape
    vb = cfg.block_rows
    inv = 1.0 / math.sqrt(d)
    f32 = jnp.float32
    dout = dout.astype(f32)
    big_d = jnp.sum(dout * out.astype(f32), axis=-1)  # [n]
    seg_sum = partial(jax.ops.segment_sum, num_segments=vb, indices_are_sorted=True)

    def window_add(acc, first, rows_b):
        old = jax.lax.dynamic_slice(acc, (first, 0), (vb, acc.shape[1]))
        return jax.lax.dynamic_update_slice(acc, old + rows_b, (first, 0))

    def block(carry, xs):
        row_b, start_b, len_b = xs
        slots, ok, c, qb, kb, s, a = _scores(cfg, q, k, scale, bias, cols, row_b, start_b, len_b)
        w = jnp.where(ok, jnp.exp(a - lse.at[row_b].get(mode="promise_in_bounds")[:, None]), 0.0)
        dob = dout.at[row_b].get(mode="promise_in_bounds")  # [Vb, dv]
        vals = v.at[c].get(mode="promise_in_bounds").astype(f32)
        dp = jnp.einsum("vd,vrd->vr", dob, vals)
        if cfg.has_dropout:
            zb = z.at[slots].get(mode="promise_in_bounds")
            dp, wz = dp * zb, w * zb
        else:
            wz = w
        da = w * (dp - big_d.at[row_b].get(mode="promise_in_bounds")[:, None])
        carry = dict(carry)
        if cfg.has_scale:
            ds = da * scale.at[slots].get(mode="promise_in_bounds") * inv
            carry["dscale"] = carry["dscale"].at[slots].add(jnp.where(ok, da * s, 0.0))
        else:
            ds = da * inv
        if cfg.has_bias:
            carry["dbias"] = carry["dbias"].at[slots].add(jnp.where(ok, da, 0.0))
        first, local = _local_rows(row_b, vb)
        carry["dq"] = window_add(
            carry["dq"], first, seg_sum(jnp.einsum("vr,vrd->vd", ds, kb), local)
        )
        carry["dk"] = carry["dk"].at[c].add(ds[:, :, None] * qb[:, None, :])
        carry["dv"] = carry["dv"].at[c].add(wz[:, :, None] * dob[:, None, :])
        return carry

    init = {
        "dq": jnp.zeros((n + vb, d), f32),
        "dk": jnp.zeros(k.shape, f32),
        "dv": jnp.zeros(v.shape, f32),
    }
    if cfg.has_scale:
        init["dscale"] = jnp.zeros_like(scale)
    if cfg.has_bias:
        init["dbias"] = jnp.zeros_like(bias)
    reads = (q, k, v, scale, bias, z, cols, lse, dout)
    grads = _for_blocks(blocks, vb, block, init, reads)
    grads["dq"] = grads["dq"][:n]
    return grads


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rows_attention(cfg, q, k, v, scale, bias, z, cols, blocks):
    """``(out, lse)``; ``lse``'s cotangent is dropped (callers stop its gradient)."""
    return _forward(cfg, q, k, v, scale, bias, z, cols, blocks)


def _rows_fwd(cfg, q, k, v, scale, bias, z, cols, blocks):
    out, lse = _forward(cfg, q, k, v, scale, bias, z, cols, blocks)
    # Tagged so that a jax.checkpoint policy can keep them (see EDGE_KERNEL_RESIDUAL_NAMES).
    out_name, lse_name = EDGE_KERNEL_RESIDUAL_NAMES
    out, lse = checkpoint_name(out, out_name), checkpoint_name(lse, lse_name)
    return (out, lse), (q, k, v, scale, bias, z, cols, blocks, out, lse)


@scoped(EDGE_KERNEL)
def _rows_bwd(cfg, res, cts):
    dout, _ = cts  # lse is returned under stop_gradient: its cotangent is zero
    q, k, v, scale, bias, z, cols, blocks, out, lse = res
    g = _backward(cfg, q, k, v, scale, bias, z, cols, blocks, out, lse, dout)
    zero_ints = jax.tree.map(lambda _: None, (cols, blocks))
    return (
        g["dq"].astype(q.dtype),
        g["dk"].astype(k.dtype),
        g["dv"].astype(v.dtype),
        g["dscale"] if cfg.has_scale else jnp.zeros_like(scale),
        g["dbias"] if cfg.has_bias else jnp.zeros_like(bias),
        jnp.zeros_like(z),
        *zero_ints,
    )


_rows_attention.defvjp(_rows_fwd, _rows_bwd)


def slot_terms(
    capacity: int,
    edge_scale: jax.Array | None,
    edge_bias: jax.Array | None,
    dropout_rate: float,
    dropout_rng: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-slot float32 scale, bias and dropout factor (keep / (1 - rate)) a
    virtual-row kernel reads; each absent one is a ``[1]`` placeholder its config skips.
    The keep mask is drawn over the ``capacity`` slots as the segment kernel draws it."""
    placeholder = jnp.zeros((1,), jnp.float32)
    # Only valid slots are ever read, so the scale needs no masking (and no copy).
    scale = placeholder if edge_scale is None else edge_scale.astype(jnp.float32)
    bias = placeholder if edge_bias is None else edge_bias.astype(jnp.float32)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = bernoulli(dropout_rng, 1.0 - dropout_rate, (capacity,))
        z = jnp.where(keep, 1.0 / (1.0 - dropout_rate), 0.0).astype(jnp.float32)
    else:
        z = placeholder
    return scale, bias, z


@scoped(EDGE_KERNEL)
def rows_edge_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    edges: EdgeList,
    *,
    edge_scale: jax.Array | None = None,
    edge_bias: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    slots_per_row: int | None = None,
    block_slots: int | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Same contract as :func:`sbm_jax.edge_ops.edge_attention` (``impl="rows"``).

    Args:
      q: ``[n, d]``; k: ``[m, d]``; v: ``[m, dv]``.
      edges: an EdgeList honouring the layout contract (valid edges first, row-sorted).
      edge_scale: optional ``[C]`` factor on each edge's score.
      edge_bias: optional ``[C]`` term added to each edge's logit (after the scale).
      dropout_rate, dropout_rng: attention dropout on the normalised weights; the keep
        mask is drawn over the ``C`` slots exactly as the segment implementation draws it.
      slots_per_row: ``R`` (static); default :func:`default_slots_per_row`.
      block_slots: slots per streamed block (static); the block holds
        ``max(1, block_slots // R)`` virtual rows. Default
        :func:`default_block_slots` of the capacity.
      return_lse: also return the per-row log-normaliser the backward pass keeps (``[n]``
        float32, 0 for a row without edges), under ``stop_gradient``.

    Returns:
      ``[n, dv]`` (or ``(out, lse)``); rows without a valid edge are exactly 0; empty
      slots get zero gradient.
    """
    n = q.shape[0]
    edges.check_operands(n, k.shape[0], edge_scale=edge_scale, edge_bias=edge_bias)
    cap = edges.capacity
    r = default_slots_per_row(cap, n) if slots_per_row is None else int(slots_per_row)
    if r < 1:
        raise ValueError(f"slots_per_row must be >= 1, got {slots_per_row}")
    if block_slots is None:
        block_slots = default_block_slots(cap)
    if block_slots < 1:
        raise ValueError(f"block_slots must be >= 1, got {block_slots}")
    vb = max(1, min(block_slots // r, n + -(-cap // r)))
    blocks = row_blocks(edges, n, slots_per_row=r, block_rows=vb)
    has_scale, has_bias, has_dropout = (
        edge_scale is not None,
        edge_bias is not None,
        dropout_rate > 0.0 and dropout_rng is not None,
    )
    scale, bias, z = slot_terms(cap, edge_scale, edge_bias, dropout_rate, dropout_rng)
    cfg = _Config(
        slots_per_row=r,
        block_rows=vb,
        has_scale=has_scale,
        has_bias=has_bias,
        has_dropout=has_dropout,
    )
    cols = edges.cols.astype(jnp.int32)
    out, lse = _rows_attention(cfg, q, k, v, scale, bias, z, cols, blocks)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out
