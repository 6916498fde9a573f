"""The SBM layer's dense-graph path, streamed over blocks of query rows.

The dense path samples every pair ``(i, j)`` of one (example, head): ``p = (Y S) Z^T``
(``ys [n, k]``, ``zk [m, k]``), a mask ``M_ij ~ Bernoulli(min(1, p_ij + delta))`` (or
the poisson law ``1 - exp(-(p_ij + delta))``) on real pairs, forced edges (self-loops,
a local window) on top, and softmax attention over the mask. Done naively it holds
``[n, m]`` probabilities, masks, scores and weights in the forward pass and again in
the backward pass, and a ``lax.switch`` that contains it reserves them whichever branch
runs.

Here nothing of size ``n x m`` ever exists. The queries are walked in blocks of
``bq`` rows (a tile is ``bq x m``, the whole key axis, so each row's softmax is exact
within its tile and needs no merge across tiles):

* forward (``lax.map`` over blocks): the block's ``p`` from its rows of ``Y S`` and all
  of ``Z`` (one ``[bq, k] x [k, m]`` product), its mask from uniforms drawn with the key
  folded with the block index, scores ``q k^T / sqrt(d)`` in float32, masked softmax,
  dropout (its keep mask also from a key folded with the block index), ``w v``. Kept:
  the output and each row's log-normaliser.
* backward (``jax.custom_vjp``, loops over tiles of ``rows x KEY_CHUNK`` pairs, the key
  chunks outside, see :func:`_backward_tiles`): a tile's ``p``, mask and scores are
  recomputed (its uniforms are the forward's own, computed for the tile alone from
  their flat indices, JAX's partitionable threefry, so nothing is stored),
  ``w = exp(s - lse)``, ``D_i = dOut_i . out_i`` for the softmax Jacobian (valid with
  dropout), and the estimator of the mask (``ste``) sends ``dL/dM_e`` to ``p_e`` on the
  edges: ``G = where(M, dL/dM, 0)``, then ``d(Y S) = G Z`` and ``dZ = G^T (Y S)`` tile
  by tile. Row-side gradients are added into the outputs in place; ``dK``, ``dV`` and
  ``dZ`` are one key chunk's accumulators, so the backward pass holds nothing of one
  graph's size beside its inputs and gradients (``[m, k]`` accumulators, a layer's
  largest, would be 16 MiB per graph at ``m=16384``, ``k=128``).

Many graphs (:func:`streamed_sbm_attention_graphs`) run one after another under one
custom VJP, their inputs and gradients read and written in place.

Estimators (``ste``), with ``a`` the normalised weights of row ``i``, ``g = dL/da``,
``da_e = a_e (g_e - sum_j a_ij g_ij)`` the logit cotangent and ``c`` the cotangent of
the edge count (the density term):

* ``"paper"`` (eq. 9, logit ``s_e * M_e``): ``dL/dp_e = da_e * s_e + c``;
* ``"reference"`` (the released code, mask on the post-softmax weights, rows
  renormalised, ``hardtanh`` backward): ``dL/dp_e = clip(da_e + c, -1, 1)``.
* ``"pairs"`` (ours, not in the paper; every pair here, probes on an edge list:
  :mod:`sbm_jax.kernels.pairs`): every real pair gets the first-order change of ``L``
  when it is flipped. On an edge, ``da_e + c`` (removing it); on an absent pair,
  ``sigma_e (g_e - sum_j a_ij g_ij) + c`` with ``sigma_e = sigmoid(s_e - lse_i)``, the
  weight the pair would take if it were added (1 in a row without edges). A row's
  edges' ``da`` sum to zero and its eq. 9 terms ``da_e s_e`` sum to ``dL/d beta_i``, the
  derivative in a common scale of the row's scores, so under ``"paper"`` and
  ``"reference"`` a row's density moves with its score temperature or not at all; here
  the absent pairs carry whether more keys would help (docs/synthetic.md, "The pairs
  estimator").

Temporaries are ``O(bq m)`` per forward block and ``O(rows x KEY_CHUNK)`` per backward
tile, plus the forward's per-graph operands. FLOPs per pair: ``2k`` (p) + ``4d``
(scores, ``w v``) forward, ``6k + 10d`` backward (p again, the two products of ``G``;
scores again, ``dOut V^T``, dQ, dK, dV), plus two uniforms per pair (mask, forward and
backward).
Plain ``jax.numpy`` / ``lax``: runs on CPU, GPU and TPU alike.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from sbm_jax._random import uniform, uniform_window, windowed_words
from sbm_jax._scopes import DENSE_PATH, scoped
from sbm_jax._varying import vary_like
from sbm_jax.kernels.rows import EDGE_KERNEL_RESIDUAL_NAMES
from sbm_jax.ste import check_ste

#: Elements of one ``bq x m`` tile the block size aims at (``bq`` rows of all keys).
DEFAULT_TILE_ELEMENTS = 2**17


class DenseConfig(NamedTuple):
    """Static settings of :func:`streamed_sbm_attention`."""

    block_rows: int  # bq
    law: str  # "bernoulli" or "poisson"
    ste: str  # "paper", "reference" or "pairs"
    forced_half: int  # forced edges |i - j| <= forced_half; -1 for none
    dropout_rate: float  # 0.0: no dropout


def default_block_rows(n: int, m: int, tile_elements: int = DEFAULT_TILE_ELEMENTS) -> int:
    """``bq``: a power of two with ``bq * m`` near ``tile_elements``, in ``[8, 512]`` and at
    most ``n`` rounded up to a power of two."""
    want = max(1, tile_elements // max(1, m))
    bq = 2 ** max(0, math.floor(math.log2(want)))
    cap = 2 ** math.ceil(math.log2(max(1, n)))
    return int(min(max(8, min(512, bq)), max(1, cap)))


def block_mask(
    cfg: DenseConfig,
    key: jax.Array,
    block: jax.Array,
    ys_b: jax.Array,
    zk: jax.Array,
    delta: jax.Array,
    qm_b: jax.Array,
    k_mask: jax.Array,
    row_offset: jax.Array | int = 0,
) -> jax.Array:
    """``[bq, m]`` bool: the mask of query block ``block`` (rows ``block * bq + [0, bq)``).


    ``ys_b [bq, k]`` are the block's rows of ``Y S`` (zero on padded queries), ``zk
    [m, k]`` the key memberships, ``qm_b [bq]``, ``k_mask [m]`` the real tokens. Pair
    ``(i, j)`` is present with probability ``min(1, p + delta)`` (bernoulli) or
    ``1 - exp(-(p + delta))`` (poisson) when both tokens are real, from uniforms drawn
    with ``fold_in(key, block)``; forced pairs ``|i - j| <= forced_half`` are added.
    The same arguments give the same mask, which is how the backward pass regenerates
    it. ``row_offset``: the position of row 0 (the forced pairs are placed by position),
    for queries that are a slice of a longer sequence.
    """
    bq, m = ys_b.shape[0], zk.shape[0]
    # Kept, not fused: the hash would otherwise be recomputed in each consumer of the
    # mask.
    u = jax.lax.optimization_barrier(uniform(jax.random.fold_in(key, block), (bq, m)))
    return _pair_mask(cfg, u, ys_b, zk, delta, qm_b, k_mask, row_offset + block * bq, 0)


def _pair_mask(cfg, u, ys_b, zk, delta, qm_b, k_mask, row0, col0) -> jax.Array:
    """``[rows, keys]`` bool: the pairs of rows ``row0 + [0, rows)`` (positions) and keys
    ``col0 + [0, keys)`` present for the uniforms ``u``, as :func:`block_mask` says."""
    p = jnp.dot(ys_b.astype(jnp.float32), zk.astype(jnp.float32).T)
    rate = p + delta
    prob = jnp.minimum(rate, 1.0) if cfg.law == "bernoulli" else -jnp.expm1(-rate)
    mask = (u < prob) & qm_b[:, None] & k_mask[None, :]
    if cfg.forced_half >= 0:
        # Padded tokens get far-apart positions, so no forced pair touches them. Every
        # [rows, keys] value here depends on the (per-graph) masks: under an outer loop
        # over graphs, a tile computed from the block index alone is loop-invariant, and
        # JAX would hoist it out of the loop stacked over all blocks (an n x m array).
        far = 2**29
        rows = jnp.where(qm_b, row0 + jnp.arange(qm_b.shape[0]), -far)
        cols = jnp.where(k_mask, col0 + jnp.arange(k_mask.shape[0]), far)
        mask = mask | (jnp.abs(rows[:, None] - cols[None, :]) <= cfg.forced_half)
    return mask


def _dropout_scale(cfg: DenseConfig, drop_key, block, shape) -> jax.Array:
    return _keep_scale(cfg, uniform(jax.random.fold_in(drop_key, block), shape))


def _keep_scale(cfg: DenseConfig, u: jax.Array) -> jax.Array:
    """Inverted dropout's factor on each weight from its uniform (``bernoulli`` is
    ``uniform < p``): ``1 / (1 - rate)`` kept, 0 dropped."""
    return jnp.where(u < 1.0 - cfg.dropout_rate, 1.0 / (1.0 - cfg.dropout_rate), 0.0)


def _blocks(a: jax.Array, bq: int, n_pad: int) -> jax.Array:
    pad = n_pad - a.shape[0]
    widths = ((0, pad),) + ((0, 0),) * (a.ndim - 1)
    return jnp.pad(a, widths).reshape(n_pad // bq, bq, *a.shape[1:])


def _contract_rows(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a.T @ b`` as ``[a_cols, b_cols]``, contracting the block's rows.

    The backward pass accumulates the key-side gradients ``ds.T @ q_b`` etc. transposed,
    as ``q_b.T @ ds`` (``[d, m]``, transposed once after the loop): on CPU, XLA ran the
    ``[m, bq] x [bq, d]`` form as a generic dot and this one faster.
    """
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())))


def _tile(cfg, key, b, q_b, ys_b, qm_b, k, zk, delta, k_mask, offset):
    """Mask and float32 scores of one block: ``([bq, m] bool, [bq, m] f32)``."""
    mask = block_mask(cfg, key, b, ys_b, zk, delta, qm_b, k_mask, offset)
    s = jnp.dot(q_b.astype(jnp.float32), k.astype(jnp.float32).T) / math.sqrt(q_b.shape[-1])
    return mask, s


def _pair_gain(mask, has, s, lse_b, dw, d_b, da):
    """``[bq, m]``: the ``"pairs"`` estimator's ``dL/dM`` on every pair of a block.

    On an edge, the logit cotangent ``da`` (the derivative of ``L`` in a weight ``M`` on
    ``exp(s)``). On an absent pair, the first-order change of ``L`` when the pair is
    added: the row's output moves to ``out + sigma (v_j - out)`` with ``sigma =
    e^s / (Z + e^s) = sigmoid(s - lse)`` (1 in a row without edges, whose output is 0),
    so ``dL ~ sigma (dOut . v_j - dOut . out) = sigma (dw - D)``. ``has [bq]``: whether
    the row has an edge among all its keys (the forward pass's).
    """
    sigma = jnp.where(has[:, None], jax.nn.sigmoid(s - lse_b[:, None]), 1.0)
    return jnp.where(mask, da, sigma * (dw - d_b[:, None]))


def _forward(cfg, q, k, v, ys, zk, delta, key, drop_key, q_mask, k_mask, offset):
    n, bq = q.shape[0], cfg.block_rows
    n_pad = -(-n // bq) * bq
    xs = (
        jnp.arange(n_pad // bq, dtype=jnp.int32),
        _blocks(q, bq, n_pad),
        _blocks(ys, bq, n_pad),
        _blocks(q_mask, bq, n_pad),
    )
    v32 = v.astype(jnp.float32)

    def block(x):
        b, q_b, ys_b, qm_b = x
        mask, s = _tile(cfg, key, b, q_b, ys_b, qm_b, k, zk, delta, k_mask, offset)
        mx = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        e = jnp.where(mask, jnp.exp(s - mx[:, None]), 0.0)
        denom = jnp.sum(e, axis=-1)
        has = denom > 0
        w = e / jnp.where(has, denom, 1.0)[:, None]
        if cfg.dropout_rate > 0.0:
            w = w * _dropout_scale(cfg, drop_key, b, w.shape)
        out_b = jnp.dot(w, v32)
        # +inf in a row without an edge: the backward pass reads "no edge" from it.
        lse_b = jnp.where(has, mx + jnp.log(jnp.where(has, denom, 1.0)), jnp.inf)
        return out_b, lse_b, jnp.sum(mask, dtype=jnp.int32)

    out, lse, counts = jax.lax.map(block, xs)
    out = out.reshape(n_pad, -1)[:n]
    return out, lse.reshape(n_pad)[:n], jnp.sum(counts)


# The graphs of a call one after another (``lax.map`` forward, ``lax.fori_loop``
# backward) under one custom VJP. The residuals are the inputs themselves, the outputs
# and each row's log-normaliser; the backward pass walks each graph in tiles of
# ``rows x key_chunk`` pairs (:func:`_backward_tiles`), reading its rows and keys
# straight out of the ``[G, ...]`` inputs and adding into the ``[G, ...]`` gradients, so
# nothing of one graph's size is held beside them but a key chunk's accumulators.
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _streamed_graphs(cfg, q, k, v, ys, zk, delta, key, drop_key, q_mask, k_mask, offset):
    (out, count), _ = _streamed_graphs_fwd(
        cfg, q, k, v, ys, zk, delta, key, drop_key, q_mask, k_mask, offset
    )
    return out, count


def _graphs_forward(cfg: DenseConfig, args: tuple) -> tuple[jax.Array, ...]:
    """The forward pass: ``(out, lse, count)`` of ``G`` graphs (``[G, n,
    dv]`` float32, ``[G, n]`` with +inf in rows without an edge, ``[G]`` int32) for the
    operands ``(q, k, v, ys, zk, delta, keys, dropout_keys, q_mask, k_mask, row_offsets)``
    with a leading axis ``G`` (as :func:`streamed_sbm_attention_graphs` builds them)."""
    return jax.lax.map(lambda a: _forward(cfg, *a), args)


def _streamed_graphs_fwd(cfg, *args):
    out, lse, count = _graphs_forward(cfg, args)
    # Tagged as the edge kernels tag theirs: under a jax.checkpoint that keeps these names
    # (the layer's branch policy) the backward pass does not run the forward again.
    out_name, lse_name = EDGE_KERNEL_RESIDUAL_NAMES
    out, lse = checkpoint_name(out, out_name), checkpoint_name(lse, lse_name)
    v = args[2]
    return (out.astype(v.dtype), count.astype(jnp.float32)), (*args, out, lse)


#: Keys per column chunk of a backward tile.
KEY_CHUNK = 512


def _backward_tiles(n: int, m: int, bq: int, windowed: bool) -> tuple[int, int]:
    """``(rows, keys)`` of a backward tile: a multiple of the forward's ``bq`` rows and
    up to :data:`KEY_CHUNK` keys, about :data:`DEFAULT_TILE_ELEMENTS` pairs. Where a
    window of the forward's uniforms cannot be drawn on its own (not JAX's partitionable
    threefry), the forward's own tiles: ``bq`` rows of all keys."""
    if not windowed:
        return bq, m
    chunk = min(KEY_CHUNK, m)
    rows = bq * max(1, DEFAULT_TILE_ELEMENTS // chunk // bq)
    return min(rows, -(-n // bq) * bq), chunk


def _window(a: jax.Array, g, start, size: int) -> jax.Array:
    """``a[g, start:start + size]`` (``a [G, L, ...]``) in one dynamic slice."""
    starts = (g, start) + (0,) * (a.ndim - 2)
    return jax.lax.dynamic_slice(a, starts, (1, size, *a.shape[2:]))[0]


def _pad_axis1(a: jax.Array, size: int) -> jax.Array:
    if a.shape[1] == size:
        return a
    return jnp.pad(a, ((0, 0), (0, size - a.shape[1])) + ((0, 0),) * (a.ndim - 2))


def _tile_uniforms(key, windowed, bq, m, r0, rows, c0, chunk):
    """``[rows, chunk]``: the forward's uniforms of pairs ``(r0 + a, c0 + b)``. Row ``i``
    belongs to forward block ``i // bq``, whose draw is ``uniform(fold_in(key, i // bq),
    (bq, m))``; pair ``(i, j)`` is its entry ``(i % bq) * m + j``."""
    if not windowed:  # rows == bq, chunk == all keys: the forward's tile itself
        u = uniform(jax.random.fold_in(key, r0 // bq), (bq, m))
        return jnp.pad(u, ((0, 0), (0, chunk - m)))
    blocks = r0 // bq + jnp.arange(rows // bq)
    block_words = windowed_words(jax.vmap(lambda b: jax.random.fold_in(key, b))(blocks))
    row_words = jnp.repeat(block_words, bq, axis=0)  # [rows, 2]
    i = jnp.arange(rows, dtype=jnp.uint32) % np.uint32(bq)
    j = (c0 + jnp.arange(chunk)).astype(jnp.uint32)
    return uniform_window(row_words[:, None, :], i[:, None] * np.uint32(m) + j[None, :])


def _streamed_graphs_bwd(cfg, res, cts):
    args, out, lse = res[:-2], res[-2], res[-1]
    grads = _graphs_backward(cfg, args, out, lse, *cts)
    q, k, v, ys, zk, delta = args[:6]
    cts_in = [g.astype(a.dtype) for g, a in zip(grads, (q, k, v, ys, zk), strict=True)]
    return (*cts_in, jnp.zeros_like(delta), None, None, None, None, None)


@scoped(DENSE_PATH)
def _graphs_backward(
    cfg: DenseConfig, args: tuple, out: jax.Array, lse: jax.Array, dout: jax.Array, dcount
) -> tuple[jax.Array, ...]:
    """The backward pass: float32 cotangents of ``(q, k, v, ys, zk)`` from
    :func:`_graphs_forward`'s ``out`` and ``lse``, the output's cotangent and the
    edge counts' (``[G]``)."""
    q, k, v, ys, zk, delta, keys, drop_keys, q_mask, k_mask, offset = args
    carry_like = (args, out, lse, dout, dcount)  # the loops' carries vary like these
    f32 = jnp.float32
    n_graphs, n, d = q.shape
    m, kc = k.shape[1], ys.shape[-1]
    bq = cfg.block_rows
    dropout = cfg.dropout_rate > 0.0
    windowed = windowed_words(keys) is not None and (
        not dropout or windowed_words(drop_keys) is not None
    )
    rows, chunk = _backward_tiles(n, m, bq, windowed)
    n_pad, m_pad = -(-n // rows) * rows, -(-m // chunk) * chunk
    inv = 1.0 / math.sqrt(d)
    dout = dout.astype(f32)
    big_d = jnp.sum(dout * out, axis=-1)  # [G, n]: D_i = dOut_i . out_i
    dcount = jnp.asarray(dcount, f32)
    q_, ys_, qm_, lse_, do_, bd_ = (_pad_axis1(a, n_pad) for a in (q, ys, q_mask, lse, dout, big_d))
    k_, v_, zk_, km_ = (_pad_axis1(a, m_pad) for a in (k, v, zk, k_mask))

    def tile(g, r0, c0, key, drop_key, keys_c):
        """Cotangents of one tile: row side ``(dq, dys)``, key side ``(dk, dv, dzk)``;
        ``keys_c``: the key chunk's ``k``, ``v``, ``zk`` and mask."""
        q_b, ys_b = _window(q_, g, r0, rows).astype(f32), _window(ys_, g, r0, rows).astype(f32)
        qm_b, lse_b = _window(qm_, g, r0, rows), _window(lse_, g, r0, rows)
        do_b, d_b = _window(do_, g, r0, rows), _window(bd_, g, r0, rows)
        k_c, v_c, zk_c, km_c = keys_c
        # The mask exactly as block_mask draws it in the forward pass.
        u = _tile_uniforms(key, windowed, bq, m, r0, rows, c0, chunk)
        mask = _pair_mask(cfg, u, ys_b, zk_c, delta[g], qm_b, km_c, offset[g] + r0, c0)
        s = jnp.dot(q_b, k_c.T) * inv
        w = jnp.where(mask, jnp.exp(s - lse_b[:, None]), 0.0)
        dw = jnp.dot(do_b, v_c.T)  # [rows, chunk]
        if dropout:
            z = _keep_scale(cfg, _tile_uniforms(drop_key, windowed, bq, m, r0, rows, c0, chunk))
            dw, wz = dw * z, w * z
        else:
            wz = w
        da = w * (dw - d_b[:, None])  # logit cotangent, 0 off the mask
        if cfg.ste == "pairs":
            # Every real pair: its gain or loss to first order, plus the count's term
            # (d E[count] / dp = 1 on every pair, not only on the sampled ones).
            real = qm_b[:, None] & km_c[None, :]
            gain = _pair_gain(mask, jnp.isfinite(lse_b), s, lse_b, dw, d_b, da)
            gm = jnp.where(real, gain + dcount[g], 0.0)
        else:
            # dL/dM on the edges: the logit's derivative in M, plus the edge count's term.
            g_m = (da * s if cfg.ste == "paper" else da) + dcount[g]
            if cfg.ste == "reference":
                g_m = jnp.clip(g_m, -1.0, 1.0)
            gm = jnp.where(mask, g_m, 0.0)  # [rows, chunk] cotangent of p on the edges
        ds = da * inv
        row_side = (jnp.dot(ds, k_c), jnp.dot(gm, zk_c))
        # Transposed ([., chunk]), as _contract_rows says why; transposed back per chunk.
        key_side = (_contract_rows(q_b, ds), _contract_rows(do_b, wz), _contract_rows(ys_b, gm))
        return row_side, key_side

    def add_rows(acc, g, r0, part):
        return jax.lax.dynamic_update_slice(
            acc, (_window(acc, g, r0, rows) + part)[None], (g, r0, 0)
        )

    def graph(g, grads):
        key, drop_key = keys[g], drop_keys[g]

        def key_chunk(c, grads):
            c0 = c * chunk
            # Sliced once per chunk, read by every row block of it.
            keys_c = tuple(_window(a, g, c0, chunk) for a in (k_, v_, zk_, km_))
            keys_c = (*(a.astype(f32) for a in keys_c[:3]), keys_c[3])

            def row_block(b, carry):
                (dq, dys), acc = carry
                r0 = b * rows
                (dq_t, dys_t), acc_t = tile(g, r0, c0, key, drop_key, keys_c)
                rows_out = (add_rows(dq, g, r0, dq_t), add_rows(dys, g, r0, dys_t))
                return rows_out, tuple(a + t for a, t in zip(acc, acc_t, strict=True))

            dq, dys, dk, dv, dzk = grads
            acc0 = vary_like(
                (jnp.zeros((d, chunk), f32), jnp.zeros((v.shape[-1], chunk), f32),
                 jnp.zeros((kc, chunk), f32)),
                carry_like,
            )  # fmt: skip
            (dq, dys), (ak, av, az) = jax.lax.fori_loop(
                0, n_pad // rows, row_block, ((dq, dys), acc0)
            )
            dk, dv, dzk = (
                jax.lax.dynamic_update_slice(a, t.T[None], (g, c0, 0))
                for a, t in ((dk, ak), (dv, av), (dzk, az))
            )
            return dq, dys, dk, dv, dzk

        return jax.lax.fori_loop(0, m_pad // chunk, key_chunk, grads)

    zeros = vary_like(
        tuple(
            jnp.zeros((n_graphs, size, a.shape[-1]), f32)
            for a, size in ((q, n_pad), (ys, n_pad), (k, m_pad), (v, m_pad), (zk, m_pad))
        ),
        carry_like,
    )  # fmt: skip
    dq, dys, dk, dv, dzk = jax.lax.fori_loop(0, n_graphs, graph, zeros)
    return dq[:, :n], dk[:, :m], dv[:, :m], dys[:, :n], dzk[:, :m]


_streamed_graphs.defvjp(_streamed_graphs_fwd, _streamed_graphs_bwd)
#: The custom VJP's two halves, for a caller that picks between this path and another per
#: batch under one VJP of its own (``sbm_core``'s fused path): ``graphs_fwd(cfg, *args)``
#: gives ``((out, count), residuals)``, ``graphs_bwd(cfg, residuals, (dout, dcount))`` the
#: cotangents of ``args``.
graphs_fwd = _streamed_graphs_fwd
graphs_bwd = _streamed_graphs_bwd


@scoped(DENSE_PATH)
def streamed_sbm_attention(
    key: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ys: jax.Array,
    zk: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: float | jax.Array,
    *,
    law: str = "bernoulli",
    ste: str = "paper",
    forced_half: int | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    block_rows: int | None = None,
    row_offset: jax.Array | int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Sample the SBM graph of one (example, head) pair by pair and attend over it.

    Args:
      key: PRNG key of the graph; block ``b``'s uniforms come from ``fold_in(key, b)``.
      q: ``[n, d]``; k: ``[m, d]``; v: ``[m, dv]``.
      ys: ``[n, k]`` ``Y S`` with padded queries' rows zero (``SamplingPlan.ys``).
      zk: ``[m, k]`` key memberships, padded keys zero (``SamplingPlan.z[:, :k]``).
      q_mask, k_mask: ``[n]``, ``[m]`` bool, True for real tokens.
      delta: exploration probability added to every real pair.
      law: ``"bernoulli"`` or ``"poisson"`` (see :func:`block_mask`).
      ste: ``"paper"``, ``"reference"`` or ``"pairs"``: the estimator of the mask (module
        docstring).
      forced_half: forced edges ``|i - j| <= forced_half`` between real tokens (0: the
        self-loops); None for none.
      dropout_rate, dropout_rng: dropout on the normalised weights (keep mask of block
        ``b`` from ``fold_in(dropout_rng, b)``).
      block_rows: ``bq`` (static); default :func:`default_block_rows`.
      row_offset: position of query 0 in the sequence (traced is fine), when ``q`` is a
        slice of the queries: the forced pairs are placed by position.

    Returns:
      ``out [n, dv]`` (rows without an edge are exactly 0) and the edge count ``[]``
      float32, whose value is the number of edges and whose cotangent is added to every
      edge's ``dL/dM`` (so ``count / real_pairs`` is the differentiable density).
      Gradients reach ``q``, ``k``, ``v``, ``ys`` and ``zk``.
    """
    drop_key = key if dropout_rng is None else dropout_rng
    one = partial(jnp.expand_dims, axis=0)
    out, count = streamed_sbm_attention_graphs(
        one(key), one(q), one(k), one(v), one(ys), one(zk), one(q_mask), one(k_mask),
        one(jnp.asarray(delta, jnp.float32)), law=law, ste=ste, forced_half=forced_half,
        dropout_rate=dropout_rate, dropout_rngs=None if dropout_rng is None else one(drop_key),
        block_rows=block_rows, row_offsets=one(jnp.asarray(row_offset, jnp.int32)),
    )  # fmt: skip
    return out[0], count[0]


def graphs_config_and_operands(
    keys: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ys: jax.Array,
    zk: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: jax.Array,
    *,
    law: str = "bernoulli",
    ste: str = "paper",
    forced_half: int | None = None,
    dropout_rate: float = 0.0,
    dropout_rngs: jax.Array | None = None,
    block_rows: int | None = None,
    row_offsets: jax.Array | None = None,
) -> tuple[DenseConfig, tuple[jax.Array, ...]]:
    """The static config and the operands :func:`streamed_sbm_attention_graphs` hands its
    custom VJP (the arguments as there), for a caller that runs :func:`graphs_fwd` and
    :func:`graphs_bwd` itself (the fused path's switch, ``sbm_core``)."""
    check_ste(ste)
    n, m = q.shape[1], k.shape[1]
    bq = default_block_rows(n, m) if block_rows is None else int(block_rows)
    if bq < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    cfg = DenseConfig(
        block_rows=bq,
        law=law,
        ste=ste,
        forced_half=-1 if forced_half is None else int(forced_half),
        dropout_rate=float(dropout_rate) if dropout_rngs is not None else 0.0,
    )
    drop_keys = keys if dropout_rngs is None else dropout_rngs
    graphs = q.shape[:1]
    delta = jnp.broadcast_to(jnp.asarray(delta, jnp.float32), graphs)
    offsets = jnp.zeros(graphs, jnp.int32) if row_offsets is None else row_offsets
    args = (
        q, k, v, ys, zk, delta, keys, drop_keys, q_mask.astype(bool), k_mask.astype(bool),
        offsets.astype(jnp.int32),
    )  # fmt: skip
    return cfg, args


@scoped(DENSE_PATH)
def streamed_sbm_attention_graphs(
    keys: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ys: jax.Array,
    zk: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: jax.Array,
    *,
    law: str = "bernoulli",
    ste: str = "paper",
    forced_half: int | None = None,
    dropout_rate: float = 0.0,
    dropout_rngs: jax.Array | None = None,
    block_rows: int | None = None,
    row_offsets: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`streamed_sbm_attention` of ``G`` graphs, one after another: every argument
    has a leading axis ``G`` (``keys``, ``delta``, ``dropout_rngs`` and ``row_offsets``
    are ``[G]``), and so do ``out [G, n, dv]`` and the edge counts ``[G]``. Graph ``g``
    gets what :func:`streamed_sbm_attention` gives it alone (the same mask, outputs and
    gradients); its backward pass holds no per-graph copy of an input or a gradient."""
    cfg, args = graphs_config_and_operands(
        keys, q, k, v, ys, zk, q_mask, k_mask, delta, law=law, ste=ste,
        forced_half=forced_half, dropout_rate=dropout_rate, dropout_rngs=dropout_rngs,
        block_rows=block_rows, row_offsets=row_offsets,
    )  # fmt: skip
    return _streamed_graphs(cfg, *args)


def streamed_mask(
    key: jax.Array,
    ys: jax.Array,
    zk: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: float | jax.Array,
    *,
    law: str = "bernoulli",
    forced_half: int | None = None,
    block_rows: int | None = None,
    row_offset: int = 0,
) -> jax.Array:
    """The ``[n, m]`` mask :func:`streamed_sbm_attention` draws with the same arguments.

    For tests and inspection only (it materialises the mask); the attention never does.
    """
    n, m = ys.shape[0], zk.shape[0]
    bq = default_block_rows(n, m) if block_rows is None else int(block_rows)
    cfg = DenseConfig(
        block_rows=bq,
        law=law,
        ste="paper",
        forced_half=-1 if forced_half is None else int(forced_half),
        dropout_rate=0.0,
    )
    n_pad = -(-n // bq) * bq
    delta = jnp.asarray(delta, jnp.float32)
    xs = (
        jnp.arange(n_pad // bq, dtype=jnp.int32),
        _blocks(ys, bq, n_pad),
        _blocks(q_mask.astype(bool), bq, n_pad),
    )
    masks = jax.lax.map(
        lambda x: block_mask(
            cfg, key, x[0], x[1], zk, delta, x[2], k_mask.astype(bool), row_offset
        ),
        xs,
    )
    return masks.reshape(n_pad, m)[:n]
