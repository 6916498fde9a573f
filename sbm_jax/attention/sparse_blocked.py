"""Sparse Transformer patterns computed blockwise, in O(n sqrt n) instead of O(n^2).

The patterns (Child et al. 2019, "Generating Long Sequences with Sparse Transformers";
formulas in ``sparse_patterns.py``) are evaluated without any n x n array. The sequence
is padded to ``N = nb * l`` positions (``nb = ceil(n / l)`` blocks of the stride ``l``;
the added positions are keys that are never attended and queries whose outputs are
dropped) and each head type becomes one or two *parts*, each a small dense attention
between groups of queries and the keys the pattern lets that group see:

=============  ===========================  ================================  ============
part           query groups                 keys of a group                    keys/query
=============  ===========================  ================================  ============
``band``       block x (l queries)          blocks x-1, x, x+1 (causal: x-1,   3l (2l)
(strided A)                                 x), band ``|i-j| <= l`` applied
``column``     offset r (nb queries         the nb positions ``y l + r``       nb = n/l
(strided B)    ``x l + r``)                 (causal: y <= x)
``block``      block x                      block x (causal: j <= i)           l
(fixed A)
``summary``    block x                      the c summary cells of every      nb c
(fixed B)                                   block, gathered once (causal:
                                            j <= i)
=============  ===========================  ================================  ============

A head that attends to the union of A and B (one head) runs both of its parts, with the
keys A already covers removed from the B part (``column``: ``|x - y| <= 1``, causal
``0 <= x - y <= 1``; ``summary``: the query's own block), so every key of the union is
counted once. Parts are merged by one softmax over all their keys: a common
maximum per query, the sums of exponentials and the weighted values added across parts.
Padded and out-of-range keys are removed; a query that keeps no key outputs exactly 0
(the convention of ``masked.py``). Scores are computed in the input dtype and the softmax
in float32, as in ``masked.py``.

Memory: autodiff keeps each part's exponentials ``[B, h, G1, G2, K]`` (K keys per
query) for the backward pass, so forward and backward scratch is O(B H n K), never
O(n^2) (unless the pattern itself is dense, e.g. ``l = 1`` for the strided B head).
Wrapping a whole head group in ``jax.checkpoint`` (``remat=True``) was measured on CPU
(n = 4096, B = H = 2, d = 32): no smaller (the backward's own scratch is as large as
what is stored) and slower, so it is off. The fixed B part, whose K = nb c keys make
it the largest, instead goes through the query blocks in chunks (``lax.map``), each
under ``jax.checkpoint``: a chunk's scores are made, used and dropped in the forward
and again in the backward, so on CPU they stay in cache (``CHUNK_ELEMENTS``).
Pure ``jnp``/``lax``: the same code runs on CPU, GPU and TPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

_NEG = float(jnp.finfo(jnp.float32).min)

#: Scores per chunk of the fixed B (summary) part, by backend. CPU: 2^18 (1 MiB of
#: float32) was fastest of 2^18 ... 2^22 and no chunking (n = 4096 and 16384, c = 8;
#: see docs/sparse_patterns.md). Accelerators: not measured here; 2^24 keeps the
#: benchmark's shapes in one batched product.
CHUNK_ELEMENTS = {"cpu": 2**18, "default": 2**24}


@dataclass(frozen=True)
class _Part:
    """One dense sub-attention of a pattern, in its own query layout.

    ``logits``/``allowed`` are ``[B, h, G1, G2, K]`` where ``(G1, G2)`` is ``(block,
    offset)`` when ``rows`` else ``(offset, block)``; ``aggregate(w)`` maps weights of
    that shape to ``[B, h, nb, l, dv]``.
    """

    logits: Array
    allowed: Array
    aggregate: Callable[[Array], Array]
    rows: bool

    def to_rows(self, x: Array) -> Array:
        """Per-query array [B, h, G1, G2] -> [B, h, nb, l]."""
        return x if self.rows else jnp.swapaxes(x, -1, -2)

    def from_rows(self, x: Array) -> Array:
        return x if self.rows else jnp.swapaxes(x, -1, -2)


def _scores(q: Array, k: Array, spec: str, scale: Array) -> Array:
    return jnp.einsum(spec, q, k).astype(jnp.float32) * scale


def _neighbour_blocks(x: Array, left: int, right: int, axis: int) -> Array:
    """Blocks along ``axis`` (size nb) with their neighbours, concatenated on ``axis + 1``.

    x [..., nb, b, ...] -> [..., nb, (left + 1 + right) * b, ...]: entry x of the result
    holds blocks x - left, ..., x + right (zeros outside the sequence).
    """
    nb = x.shape[axis]
    if left == right == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (left, right)
    padded = jnp.pad(x, pad)
    parts = [jax.lax.slice_in_dim(padded, s, s + nb, axis=axis) for s in range(left + 1 + right)]
    return jnp.concatenate(parts, axis=axis + 1)


def _band_part(q, k, v, key_real, stride, causal, scale) -> _Part:
    """Strided A: ``|i - j| <= l`` (causal ``0 <= i - j <= l``) from neighbouring blocks."""
    nb, size = q.shape[2], q.shape[3]
    left, right = (1, 0) if causal else (1, 1)
    left, right = (0, 0) if nb == 1 else (left, right)
    kb = _neighbour_blocks(k, left, right, axis=2)  # [B, h, nb, w, d]
    vb = _neighbour_blocks(v, left, right, axis=2)
    real = _neighbour_blocks(key_real, left, right, axis=1)  # [B, nb, w]
    width = kb.shape[3]
    i = jnp.arange(nb * size, dtype=jnp.int32).reshape(nb, size, 1)
    j = (jnp.arange(nb, dtype=jnp.int32)[:, None] - left) * size + jnp.arange(
        width, dtype=jnp.int32
    )  # [nb, w]; out-of-range blocks are zeros with key_real False
    diff = i - j[:, None, :]
    pattern = (diff >= 0) & (diff <= stride) if causal else jnp.abs(diff) <= stride
    allowed = pattern[None, None] & real[:, None, :, None, :]
    logits = _scores(q, kb, "bhxrd,bhxwd->bhxrw", scale)
    return _Part(
        logits,
        allowed,
        lambda w: jnp.einsum("bhxrw,bhxwd->bhxrd", w.astype(vb.dtype), vb),
        rows=True,
    )


def _column_part(q, k, v, key_real, causal, exclude_band, scale) -> _Part:
    """Strided B: keys ``j = y l + r`` of the query's offset r (causal: y <= x)."""
    nb = q.shape[2]
    x = jnp.arange(nb, dtype=jnp.int32)[:, None]
    y = jnp.arange(nb, dtype=jnp.int32)[None, :]
    pattern = jnp.ones((nb, nb), jnp.bool_)
    if causal:
        pattern = y <= x
    if exclude_band:  # keys the band already covers, so the union counts them once
        near = ((x - y) >= 0) & ((x - y) <= 1) if causal else jnp.abs(x - y) <= 1
        pattern = pattern & ~near
    real = jnp.swapaxes(key_real, 1, 2)  # [B, l, nb]: offset r, key block y
    allowed = pattern[None, None, None] & real[:, None, :, None, :]  # [B, 1, l, nb, nb]
    logits = _scores(q, k, "bhxrd,bhyrd->bhrxy", scale)
    return _Part(
        logits,
        allowed,
        lambda w: jnp.einsum("bhrxy,bhyrd->bhxrd", w.astype(v.dtype), v),
        rows=False,
    )


def _block_part(q, k, v, key_real, causal, scale) -> _Part:
    """Fixed A: the query's own block (causal: j <= i)."""
    allowed = key_real[:, None, :, None, :]  # [B, 1, nb, 1, l]
    if causal:
        r = jnp.arange(q.shape[3], dtype=jnp.int32)
        allowed = allowed & (r[None, :] <= r[:, None])
    logits = _scores(q, k, "bhxrd,bhxsd->bhxrs", scale)
    return _Part(
        logits,
        allowed,
        lambda w: jnp.einsum("bhxrs,bhxsd->bhxrd", w.astype(v.dtype), v),
        rows=True,
    )


def summary_cells(stride: int, c: int, offsets: tuple[int, ...]) -> Array:
    """Offsets within a block of each head's summary cells -> int32 [len(offsets), c].

    Head h uses ``{l - c - o_h, ..., l - 1 - o_h}`` (mod l), the cells of
    ``fixed_pattern(..., summary_offset=o_h)``.
    """
    t = jnp.arange(c, dtype=jnp.int32)
    o = jnp.asarray(offsets, jnp.int32)[:, None]
    return (stride - c - o + t[None, :]) % stride


class _Stats(NamedTuple):
    """A part's softmax pieces per query, rows layout [B, h, nb, l(, dv)].

    ``m``: the part's maximum logit (a constant for autodiff); ``total``: sum of
    ``exp(logit - m)`` over its keys; ``num``: the same weights (after dropout) times
    the values; ``edges`` [B, h|1]: attended (real query, real key) pairs.
    """

    m: Array
    total: Array
    num: Array
    edges: Array


def _part_stats(
    part: _Part, query_real: Array, dropout_rate: float, dropout_rng: Array | None
) -> _Stats:
    """Softmax pieces of one part; query_real [B, nb', l] in rows layout."""
    s = jnp.where(part.allowed, part.logits, _NEG)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    e = jnp.where(part.allowed, jnp.exp(s - m[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    if dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, e.shape)
        e = jnp.where(keep, e / (1.0 - dropout_rate), 0.0)
    qr = part.from_rows(query_real)
    pairs = part.allowed & qr[:, None, :, :, None]
    edges = jnp.sum(pairs, axis=(2, 3, 4), dtype=jnp.float32)
    return _Stats(part.to_rows(m), part.to_rows(total), part.aggregate(e), edges)


def _merge(stats: list[_Stats]) -> tuple[Array, Array]:
    """One softmax over the keys of all parts -> (out [B, h, nb, l, dv], edges [B, h|1]).

    Queries without any key output 0.
    """
    m = stats[0].m
    for st in stats[1:]:
        m = jnp.maximum(m, st.m)
    total, num = 0.0, 0.0
    for st in stats:
        w = jnp.exp(st.m - m)  # 1 for the part holding the maximum; constants
        total = total + st.total * w
        num = num + st.num * w[..., None].astype(st.num.dtype)
    safe = jnp.where(total > 0.0, total, 1.0)
    out = num / safe[..., None].astype(num.dtype)
    return out, sum(st.edges for st in stats)


def _summary_stats(
    q,
    k,
    v,
    key_real,
    stride,
    c,
    offsets,
    causal,
    exclude_block,
    scale,
    dropout_rate,
    rng,
    chunk_elements,
) -> _Stats:
    """Fixed B: the c summary cells of every block (causal: j <= i), gathered once.

    Every query sees up to M = nb c keys, so the scores are [B, h, n, M]. When they
    exceed ``chunk_elements``, query blocks go in chunks (``lax.map``), each under
    ``jax.checkpoint``: a chunk's scores are made, used and dropped, in the forward and
    again in the backward, so they stay cache-sized instead of round-tripping memory.
    """
    batch, heads, nb, size, _ = q.shape
    cells = summary_cells(stride, c, offsets)  # [h|1, c]
    idx = cells[None, :, None, :, None]  # [1, h|1, 1, c, 1]
    ks = jnp.take_along_axis(k, idx, axis=3).reshape(batch, heads, nb * c, -1)
    vs = jnp.take_along_axis(v, idx, axis=3).reshape(batch, heads, nb * c, -1)
    real = jnp.take_along_axis(key_real[:, None], cells[None, :, None, :], axis=3)
    real = real.reshape(batch, cells.shape[0], nb * c)  # [B, h|1, M]
    key_block = jnp.repeat(jnp.arange(nb, dtype=jnp.int32), c)  # [M]
    key_pos = (jnp.arange(nb, dtype=jnp.int32)[:, None] * size + cells[:, None, :]).reshape(
        cells.shape[0], nb * c
    )  # [h|1, M]

    def chunk(qc, qr, first, rng_c):
        """qc [B, h, cb, l, d], qr [B, cb, l] for query blocks first, ..., first + cb - 1."""
        x = first + jnp.arange(qc.shape[2], dtype=jnp.int32)  # query blocks
        allowed = real[:, :, None, None, :]  # [B, h|1, 1, 1, M]
        if causal:
            i = x[:, None] * size + jnp.arange(size, dtype=jnp.int32)  # [cb, l]
            allowed = allowed & (key_pos[:, None, None, :] <= i[None, :, :, None])[None]
        if exclude_block:  # the own block's cells are in the block part already
            allowed = allowed & (key_block[None, :] != x[:, None])[:, None, :]
        part = _Part(
            _scores(qc, ks, "bhxrd,bhmd->bhxrm", scale),
            allowed,
            lambda w: jnp.einsum("bhxrm,bhmd->bhxrd", w.astype(vs.dtype), vs),
            rows=True,
        )
        return _part_stats(part, qr, dropout_rate, rng_c)

    per_block = batch * heads * size * nb * c
    cb = max(1, min(nb, chunk_elements // per_block))
    if cb >= nb:
        return chunk(q, key_real, jnp.int32(0), rng)
    nc = -(-nb // cb)
    extra = nc * cb - nb
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))
    rp = jnp.pad(key_real, ((0, 0), (0, extra), (0, 0)))
    qp = jnp.moveaxis(qp.reshape(batch, heads, nc, cb, size, -1), 2, 0)
    rp = jnp.moveaxis(rp.reshape(batch, nc, cb, size), 1, 0)
    firsts = jnp.arange(nc, dtype=jnp.int32) * cb
    if rng is None:
        fn = jax.checkpoint(lambda a: chunk(*a, None))
        out = jax.lax.map(fn, (qp, rp, firsts))
    else:
        fn = jax.checkpoint(lambda a: chunk(*a))
        out = jax.lax.map(fn, (qp, rp, firsts, jax.random.split(rng, nc)))

    def unchunk(t: Array) -> Array:  # [nc, B, h, cb, l, ...] -> [B, h, nb, l, ...]
        t = jnp.moveaxis(t, 0, 2)
        return t.reshape(*t.shape[:2], nc * cb, *t.shape[4:])[:, :, :nb]

    return _Stats(unchunk(out.m), unchunk(out.total), unchunk(out.num), out.edges.sum(0))


def _group_attention(
    q: Array,
    k: Array,
    v: Array,
    token_mask: Array,
    dropout_rng: Array | None,
    *,
    kind: str,
    types: str,
    stride: int,
    c: int,
    offsets: tuple[int, ...],
    causal: bool,
    dropout_rate: float,
    chunk_elements: int,
) -> tuple[Array, Array]:
    """Heads of one type (``types`` "A", "B" or "AB" for the union) on blocked inputs.

    q, k, v: [B, h, nb, l, d] (padded); token_mask [B, nb, l]. Returns
    (out [B, h, nb, l, dv], edges [B, h]).
    """
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
    rngs = [None, None]
    if dropout_rng is not None:
        rngs = [jax.random.fold_in(dropout_rng, t) for t in range(2)]
    stats = []
    if kind == "strided":
        if "A" in types:
            part = _band_part(q, k, v, token_mask, stride, causal, scale)
            stats.append(_part_stats(part, token_mask, dropout_rate, rngs[0]))
        if "B" in types:
            part = _column_part(q, k, v, token_mask, causal, types == "AB", scale)
            stats.append(_part_stats(part, token_mask, dropout_rate, rngs[1]))
    else:
        if "A" in types:
            part = _block_part(q, k, v, token_mask, causal, scale)
            stats.append(_part_stats(part, token_mask, dropout_rate, rngs[0]))
        if "B" in types:
            stats.append(
                _summary_stats(
                    q,
                    k,
                    v,
                    token_mask,
                    stride,
                    c,
                    offsets,
                    causal,
                    types == "AB",
                    scale,
                    dropout_rate,
                    rngs[1],
                    chunk_elements,
                )
            )
    out, edges = _merge(stats)
    return out, jnp.broadcast_to(edges, (q.shape[0], q.shape[1]))


@partial(
    jax.jit,
    static_argnames=(
        "kind",
        "stride",
        "c",
        "causal",
        "distinct_summaries",
        "dropout_rate",
        "deterministic",
        "remat",
        "chunk_elements",
    ),
)
def blocked_pattern_attention(
    q: Array,
    k: Array,
    v: Array,
    token_mask: Array,
    *,
    kind: str,
    stride: int,
    c: int = 1,
    causal: bool = False,
    distinct_summaries: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    remat: bool = False,
    chunk_elements: int | None = None,
) -> tuple[Array, Array]:
    """Sparse Transformer attention (``kind`` "strided" or "fixed"), computed blockwise.

    Heads split as in ``sparse_patterns.split_heads``: one head attends to A | B;
    otherwise heads ``[0, ceil(H/2))`` use A and the rest B (with
    ``distinct_summaries``, fixed B head number t uses summary offset ``t c mod l``).

    Args:
      q, k, v: [B, n, H, d] (v may have its own last dim).
      token_mask: bool [B, n], True for real tokens; other keys are never attended.
      kind: "strided" or "fixed".
      stride: l >= 1.
      c: summary cells per block for "fixed", 1 <= c <= l.
      causal: the autoregressive forms (j <= i).
      distinct_summaries: see above.
      dropout_rate, dropout_rng, deterministic: dropout on the attention weights
        (inverted scaling), as in ``masked_attention``.
      remat: recompute the scores in the backward pass (``jax.checkpoint``) instead of
        storing them (see the module docstring for why it is off by default).
      chunk_elements: above this many [B, h, n, nb c] scores, the fixed B (summary)
        part runs in chunks of query blocks of at most this many scores (at least one
        block), each recomputed in the backward. None: ``CHUNK_ELEMENTS`` of the
        backend (small on CPU, where it keeps a chunk in cache; large elsewhere, where
        one big batched product keeps the device busy).

    Returns:
      (out [B, n, H, dv], edges [B, H]): rows with no allowed real key are 0; edges
      counts the attended (real query, real key) pairs of each head.
    """
    if kind not in ("strided", "fixed"):
        raise ValueError(f"kind={kind!r} must be 'strided' or 'fixed'")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if kind == "fixed" and not 1 <= c <= stride:
        raise ValueError(f"c must be in [1, stride={stride}], got {c}")
    batch, n, heads, _ = q.shape
    if token_mask.shape != (batch, n):
        raise ValueError(f"token_mask shape {token_mask.shape} must be {(batch, n)}")
    use_dropout = not deterministic and dropout_rate > 0.0
    if use_dropout:
        if dropout_rate >= 1.0:
            raise ValueError(f"attention_dropout must be < 1, got {dropout_rate}")
        if dropout_rng is None:
            raise ValueError("dropout_rng is required when dropout_rate > 0 and not deterministic")
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS.get(jax.default_backend(), CHUNK_ELEMENTS["default"])
    nb = -(-n // stride)
    total = nb * stride
    token_mask = token_mask.astype(jnp.bool_)
    if total != n:
        extra = total - n
        q, k, v = (jnp.pad(t, ((0, 0), (0, extra), (0, 0), (0, 0))) for t in (q, k, v))
        token_mask = jnp.pad(token_mask, ((0, 0), (0, extra)))

    def blocks(t: Array) -> Array:  # [B, N, h, d] -> [B, h, nb, l, d]
        return jnp.transpose(t, (0, 2, 1, 3)).reshape(batch, t.shape[2], nb, stride, -1)

    real = token_mask.reshape(batch, nb, stride)
    common = dict(
        kind=kind,
        stride=stride,
        c=c,
        causal=causal,
        dropout_rate=dropout_rate,
        chunk_elements=chunk_elements,
    )
    if heads == 1:
        groups = [("AB", 0, 1, (0,))]
    else:
        num_a = heads - heads // 2
        num_b = heads - num_a
        offsets = tuple((t * c) % stride for t in range(num_b)) if distinct_summaries else (0,)
        groups = [("A", 0, num_a, (0,)), ("B", num_a, heads, offsets)]
    outs, edges = [], []
    for g, (types, lo, hi, offs) in enumerate(groups):
        fn = partial(_group_attention, types=types, offsets=offs, **common)
        if remat:
            fn = jax.checkpoint(fn)
        rng = jax.random.fold_in(dropout_rng, g) if use_dropout else None
        o, e = fn(blocks(q[:, :, lo:hi]), blocks(k[:, :, lo:hi]), blocks(v[:, :, lo:hi]), real, rng)
        outs.append(o)
        edges.append(e)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]  # [B, H, nb, l, dv]
    out = jnp.transpose(out.reshape(batch, heads, total, -1), (0, 2, 1, 3))[:, :n]
    return out, jnp.concatenate(edges, axis=1)
