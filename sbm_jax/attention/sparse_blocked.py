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
(the convention of ``masked.py``). Scores are accumulated and kept in float32 whatever the
input dtype (bf16 scores would double the error of bf16 attention) and the softmax is
float32, as in ``masked.py``; each part's weighted values are in the input dtype.

Every part goes through its query groups in chunks of at most ``chunk_elements``
scores (``lax.map``, at least one group per chunk; one chunk when the part is small),
each chunk under ``jax.checkpoint``: its scores are made, used and dropped in the
forward and made again in the backward. Forward and backward scratch is then
O(B H n K / chunks) plus O(B H n d), never n x n (unless the pattern itself is dense,
e.g. ``l = 1`` for the strided B head), and on CPU, with small chunks
(``CHUNK_ELEMENTS``), it stays in cache instead of round-tripping memory. (Plain
autodiff, storing the unchunked exponentials for the backward, was 1.6x (strided) and
3.3x (fixed) slower at n = 16384 on CPU; wrapping the whole unchunked computation in
``jax.checkpoint``, ``remat=True``, saved no memory and cost time. Figures in
docs/sparse_patterns.md.)

Pure ``jnp``/``lax``: the same code runs on CPU, GPU and TPU.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

_NEG = float(jnp.finfo(jnp.float32).min)

#: Scores per chunk of query groups, by backend (see ``_part_stats``). CPU: 2^18, the
#: fastest or near it of the sizes measured, since a chunk stays in cache
#: (docs/sparse_patterns.md has the sweep and its command).
#: Accelerators: not measured here; 2^24 keeps the benchmark's shapes in one product.
CHUNK_ELEMENTS = {"cpu": 2**18, "default": 2**24}


class _Part(NamedTuple):
    """One dense sub-attention of a pattern, for a slice of its query groups.

    ``logits``/``allowed``: [B, h, G1, G2, K] (allowed may broadcast), G1 the group
    axis (a block x, or an offset r for ``column``), G2 the queries of a group, K its
    keys; ``aggregate(w)`` maps weights of that shape to [B, h, G1, G2, dv].
    """

    logits: Array
    allowed: Array
    aggregate: Callable[[Array], Array]


class _Stats(NamedTuple):
    """A part's softmax pieces per query, [B, h, G1, G2(, dv)].

    ``m``: the part's largest logit (a constant for autodiff); ``total``: the sum of
    ``exp(logit - m)`` over its keys; ``num``: those weights (after dropout) times the
    values; ``edges`` [B, h|1]: attended (real query, real key) pairs.
    """

    m: Array
    total: Array
    num: Array
    edges: Array


def _scores(q: Array, k: Array, spec: str, scale: Array) -> Array:
    """Scores in float32 whatever the input dtype (never rounded to bf16 before the
    softmax)."""
    return jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * scale


def _stats(part: _Part, query_real: Array, dropout_rate: float, rng: Array | None) -> _Stats:
    """Softmax pieces of one part; query_real [B, G1, G2]."""
    s = jnp.where(part.allowed, part.logits, _NEG)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    e = jnp.where(part.allowed, jnp.exp(s - m[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    if rng is not None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, e.shape)
        e = jnp.where(keep, e / (1.0 - dropout_rate), 0.0)
    pairs = part.allowed & query_real[:, None, :, :, None]
    edges = jnp.sum(pairs, axis=(2, 3, 4), dtype=jnp.float32)
    return _Stats(m, total, part.aggregate(e), edges)


def _part_stats(
    make_part: Callable[..., _Part],
    grouped: tuple[Array, ...],
    query_real: Array,
    keys_per_query: int,
    *,
    dropout_rate: float,
    rng: Array | None,
    chunk_elements: int,
) -> _Stats:
    """Stats of a part over all its query groups, in chunks of groups when large.

    ``grouped``: arrays with the group axis G1 at axis 2 ([B, h, G1, ...]);
    ``query_real`` [B, G1, G2]; ``make_part(first, *slices)`` builds the part of groups
    ``first, first + 1, ...`` from slices of ``grouped``. When the part's scores exceed
    ``chunk_elements``, the groups go in chunks (``lax.map``), each under
    ``jax.checkpoint``: a chunk's scores are made, used and dropped in the forward and
    again in the backward, so they stay cache-sized instead of round-tripping memory.
    """
    batch, heads, groups, size = grouped[0].shape[:4]
    per_group = batch * heads * size * keys_per_query
    cb = max(1, min(groups, chunk_elements // per_group))

    def chunk(first, qr, rng_c, *slices):
        return _stats(make_part(first, *slices), qr, dropout_rate, rng_c)

    if cb >= groups:
        return chunk(jnp.int32(0), query_real, rng, *grouped)
    nc = -(-groups // cb)
    extra = nc * cb - groups

    def split(t: Array, axis: int) -> Array:  # group axis -> [nc, ..., cb, ...]
        pad = [(0, 0)] * t.ndim
        pad[axis] = (0, extra)
        t = jnp.pad(t, pad)
        t = t.reshape(*t.shape[:axis], nc, cb, *t.shape[axis + 1 :])
        return jnp.moveaxis(t, axis, 0)

    firsts = jnp.arange(nc, dtype=jnp.int32) * cb
    rngs = None if rng is None else jax.random.split(rng, nc)
    xs = (firsts, split(query_real, 1), rngs, *(split(t, 2) for t in grouped))
    out = jax.lax.map(jax.checkpoint(lambda a: chunk(*a)), xs)

    def join(t: Array) -> Array:  # [nc, B, h, cb, ...] -> [B, h, G1, ...]
        t = jnp.moveaxis(t, 0, 2)
        return t.reshape(*t.shape[:2], nc * cb, *t.shape[4:])[:, :, :groups]

    return _Stats(join(out.m), join(out.total), join(out.num), out.edges.sum(0))


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


def _band_stats(q, k, v, real, stride, causal, scale, **kw) -> _Stats:
    """Strided A: ``|i - j| <= l`` (causal ``0 <= i - j <= l``) from neighbouring blocks."""
    nb, size = q.shape[2], q.shape[3]
    left, right = (1, 0) if causal else (1, 1)
    left, right = (0, 0) if nb == 1 else (left, right)
    kb = _neighbour_blocks(k, left, right, axis=2)  # [B, h, nb, w, d]
    vb = _neighbour_blocks(v, left, right, axis=2)
    key_real = _neighbour_blocks(real, left, right, axis=1)[:, None]  # [B, 1, nb, w]
    width = kb.shape[3]

    def make(first, qc, kc, vc, rc):
        x = first + jnp.arange(qc.shape[2], dtype=jnp.int32)
        i = x[:, None, None] * size + jnp.arange(size, dtype=jnp.int32)[:, None]  # [cb, l, 1]
        j = (x[:, None] - left) * size + jnp.arange(width, dtype=jnp.int32)  # [cb, w]
        diff = i - j[:, None, :]  # out-of-range blocks are zeros with key_real False
        pattern = (diff >= 0) & (diff <= stride) if causal else jnp.abs(diff) <= stride
        return _Part(
            _scores(qc, kc, "bhxrd,bhxwd->bhxrw", scale),
            pattern[None, None] & rc[:, :, :, None, :],
            lambda w: jnp.einsum("bhxrw,bhxwd->bhxrd", w.astype(vc.dtype), vc),
        )

    return _part_stats(make, (q, kb, vb, key_real), real, width, **kw)


def _column_stats(q, k, v, real, causal, exclude_band, scale, **kw) -> _Stats:
    """Strided B: keys ``j = y l + r`` of the query's offset r (causal: y <= x).

    Groups are the offsets r; returned stats are [B, h, r, x(, dv)].
    """
    nb = q.shape[2]
    x = jnp.arange(nb, dtype=jnp.int32)[:, None]
    y = jnp.arange(nb, dtype=jnp.int32)[None, :]
    pattern = jnp.ones((nb, nb), jnp.bool_)
    if causal:
        pattern = y <= x
    if exclude_band:  # keys the band already covers, so the union counts them once
        near = ((x - y) >= 0) & ((x - y) <= 1) if causal else jnp.abs(x - y) <= 1
        pattern = pattern & ~near
    by_offset = [jnp.swapaxes(t, 2, 3) for t in (q, k, v)]  # [B, h, l, nb, d]
    real_t = jnp.swapaxes(real, 1, 2)  # [B, l, nb]

    def make(first, qc, kc, vc, rc):
        return _Part(
            _scores(qc, kc, "bhrxd,bhryd->bhrxy", scale),
            pattern & rc[:, :, :, None, :],
            lambda w: jnp.einsum("bhrxy,bhryd->bhrxd", w.astype(vc.dtype), vc),
        )

    return _part_stats(make, (*by_offset, real_t[:, None]), real_t, nb, **kw)


def _block_stats(q, k, v, real, causal, scale, **kw) -> _Stats:
    """Fixed A: the query's own block (causal: j <= i)."""
    size = q.shape[3]
    r = jnp.arange(size, dtype=jnp.int32)
    order = r[None, :] <= r[:, None]  # [l (query), l (key)]

    def make(first, qc, kc, vc, rc):
        allowed = rc[:, :, :, None, :]  # [B, 1, cb, 1, l]
        return _Part(
            _scores(qc, kc, "bhxrd,bhxsd->bhxrs", scale),
            allowed & order if causal else allowed,
            lambda w: jnp.einsum("bhxrs,bhxsd->bhxrd", w.astype(vc.dtype), vc),
        )

    return _part_stats(make, (q, k, v, real[:, None]), real, size, **kw)


def summary_cells(stride: int, c: int, offsets: tuple[int, ...]) -> Array:
    """Offsets within a block of each head's summary cells -> int32 [len(offsets), c].

    Head h uses ``{l - c - o_h, ..., l - 1 - o_h}`` (mod l), the cells of
    ``fixed_pattern(..., summary_offset=o_h)``.
    """
    t = jnp.arange(c, dtype=jnp.int32)
    o = jnp.asarray(offsets, jnp.int32)[:, None]
    return (stride - c - o + t[None, :]) % stride


def _summary_stats(q, k, v, real, stride, c, offsets, causal, exclude_block, scale, **kw):
    """Fixed B: the c summary cells of every block (causal: j <= i), gathered once."""
    batch, heads, nb, size, _ = q.shape
    cells = summary_cells(stride, c, offsets)  # [h|1, c]
    idx = cells[None, :, None, :, None]  # [1, h|1, 1, c, 1]
    ks = jnp.take_along_axis(k, idx, axis=3).reshape(batch, heads, nb * c, -1)
    vs = jnp.take_along_axis(v, idx, axis=3).reshape(batch, heads, nb * c, -1)
    key_real = jnp.take_along_axis(real[:, None], cells[None, :, None, :], axis=3)
    key_real = key_real.reshape(batch, cells.shape[0], nb * c)  # [B, h|1, M]
    key_block = jnp.repeat(jnp.arange(nb, dtype=jnp.int32), c)  # [M]
    key_pos = (jnp.arange(nb, dtype=jnp.int32)[:, None] * size + cells[:, None, :]).reshape(
        cells.shape[0], nb * c
    )  # [h|1, M]

    def make(first, qc):
        x = first + jnp.arange(qc.shape[2], dtype=jnp.int32)  # query blocks of the chunk
        allowed = key_real[:, :, None, None, :]  # [B, h|1, 1, 1, M]
        if causal:
            i = x[:, None] * size + jnp.arange(size, dtype=jnp.int32)  # [cb, l]
            allowed = allowed & (key_pos[:, None, None, :] <= i[None, :, :, None])[None]
        if exclude_block:  # the own block's cells are in the block part already
            allowed = allowed & (key_block[None, :] != x[:, None])[:, None, :]
        return _Part(
            _scores(qc, ks, "bhxrd,bhmd->bhxrm", scale),
            allowed,
            lambda w: jnp.einsum("bhxrm,bhmd->bhxrd", w.astype(vs.dtype), vs),
        )

    return _part_stats(make, (q,), real, nb * c, **kw)


def _merge(stats: list[_Stats]) -> tuple[Array, Array]:
    """One softmax over the keys of all parts -> (out [B, h, nb, l, dv], edges [B, h|1]).

    ``stats`` in rows layout [B, h, nb, l]. Queries without any key output 0.
    """
    m = stats[0].m
    for st in stats[1:]:
        m = jnp.maximum(m, st.m)
    total: Any = 0.0
    num: Any = 0.0
    for st in stats:
        w = jnp.exp(st.m - m)  # constants: 1 for the part holding the maximum
        total = total + st.total * w
        num = num + st.num * w[..., None].astype(st.num.dtype)
    safe = jnp.where(total > 0.0, total, 1.0)
    return num / safe[..., None].astype(num.dtype), sum(
        (st.edges for st in stats[1:]), stats[0].edges
    )


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
    rngs: list[Array | None] = [None, None]
    if dropout_rng is not None:
        rngs = [jax.random.fold_in(dropout_rng, t) for t in range(2)]
    kw = dict(dropout_rate=dropout_rate, chunk_elements=chunk_elements)
    union = types == "AB"
    stats = []
    if kind == "strided":
        if "A" in types:
            stats.append(_band_stats(q, k, v, token_mask, stride, causal, scale, rng=rngs[0], **kw))
        if "B" in types:
            col = _column_stats(q, k, v, token_mask, causal, union, scale, rng=rngs[1], **kw)
            swap = lambda t: jnp.swapaxes(t, 2, 3)  # [B, h, r, x] -> [B, h, x, r]
            stats.append(_Stats(swap(col.m), swap(col.total), swap(col.num), col.edges))
    else:
        if "A" in types:
            stats.append(_block_stats(q, k, v, token_mask, causal, scale, rng=rngs[0], **kw))
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
                    union,
                    scale,
                    rng=rngs[1],
                    **kw,
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
      chunk_elements: scores per chunk of query groups (at least one group), each
        chunk recomputed in the backward; a part with fewer scores runs in one piece.
        None: ``CHUNK_ELEMENTS`` of the backend (small on CPU, where a chunk stays in
        cache; large elsewhere, where one big batched product keeps the device busy).

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
    common: dict[str, Any] = dict(
        kind=kind,
        stride=stride,
        c=c,
        causal=causal,
        dropout_rate=dropout_rate,
        chunk_elements=chunk_elements,
    )
    if heads == 1:
        groups: list[tuple[str, int, int, tuple[int, ...]]] = [("AB", 0, 1, (0,))]
    else:
        num_a = heads - heads // 2
        num_b = heads - num_a
        offsets = tuple((t * c) % stride for t in range(num_b)) if distinct_summaries else (0,)
        groups = [("A", 0, num_a, (0,)), ("B", num_a, heads, offsets)]
    outs, edges = [], []
    for g, (types, lo, hi, offs) in enumerate(groups):
        fn: Callable[..., tuple[Array, Array]] = partial(
            _group_attention, types=types, offsets=offs, **common
        )
        if remat:
            fn = jax.checkpoint(fn)
        rng = (
            jax.random.fold_in(dropout_rng, g) if use_dropout and dropout_rng is not None else None
        )
        o, e = fn(blocks(q[:, :, lo:hi]), blocks(k[:, :, lo:hi]), blocks(v[:, :, lo:hi]), real, rng)
        outs.append(o)
        edges.append(e)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]  # [B, H, nb, l, dv]
    out = jnp.transpose(out.reshape(batch, heads, total, -1), (0, 2, 1, 3))[:, :n]
    return out, jnp.concatenate(edges, axis=1)
