"""Edge attention as a Pallas kernel for NVIDIA GPUs, lowered through Triton.

The same virtual rows as the ``rows`` kernel (:func:`sbm_jax.kernels.rows.row_blocks`:
each query's run of the row-sorted edge list cut into rows of at most ``R`` slots), but
each block of ``Vb`` virtual rows is one program of a Pallas kernel, so that a block's
gathers, scores and reductions stay in registers and its work follows its slots:

* forward: per virtual row, gather its ``R`` key/value rows (``k_ref[cols, :]``), one
  query row, and reduce to a local max ``mx``, normaliser ``l`` and unnormalised output
  ``o``; the virtual rows of each query are then merged outside the kernel with one
  segment max / sum over the ``V ~ n + C/R`` virtual rows (not over the edges).
* backward (``jax.custom_vjp``, flash-style): only ``out`` and the per-query ``lse`` are
  kept; each program recomputes its scores, writes one dQ row per virtual row (summed per
  query outside, like the forward merge), adds its dK/dV contributions into ``[m, d]``
  float32 accumulators with ``atomic_add``, and stores the per-slot gradients of the
  edge scale and bias (each valid slot belongs to exactly one virtual row).

Why Pallas with the Triton lowering: Pallas on GPU lowers to Mosaic GPU by default, which
has no gather on Hopper; the Triton lowering turns an integer-array index into a vector
of pointers (a gather) and has ``atomic_add``, which is all this kernel needs, and it
stays inside JAX (``custom_vjp``, ``vmap`` over graphs, ``jit``) with no extra package.
The kernel only runs on a GPU: on any other backend :func:`triton_edge_attention`
refuses before tracing, unless Pallas' interpret mode is asked for
(:func:`triton_mode`), which runs the same kernel body on the CPU for the tests.

Interpret mode emulates ``atomic_add`` at an integer-array index as
``ref.at[idx].set(ref[idx] + val)``, which keeps only one of several updates of the
same key row: a block that reaches one key twice would lose contributions. In interpret
mode the dK/dV accumulation is therefore an XLA scatter-add of the block into the whole
accumulator (which sums duplicates); on a GPU it is the hardware atomic add. Stores of
per-slot gradients send the block's empty lanes to a spare slot past the end, so no two
lanes of one store write the same element on either backend.

Triton needs power-of-two tensor sizes: ``R`` and ``Vb`` are powers of two, and head
dimensions that are not are zero-padded (zero columns change no dot product).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from functools import partial
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from sbm_jax._scopes import EDGE_KERNEL, scoped
from sbm_jax.graph import EdgeList
from sbm_jax.kernels.rows import (
    EDGE_KERNEL_RESIDUAL_NAMES,
    RowBlocks,
    default_slots_per_row,
    row_blocks,
    slot_terms,
)

#: Elements of one ``[Vb, R, d]`` gathered tile per program: the tile lives in the
#: registers of one program's warps, so ``Vb = TILE_ELEMENTS // (R * d)`` (at least 1).
TILE_ELEMENTS = 2**13
#: Warps per program (Triton's ``num_warps``).
NUM_WARPS = 4

Mode = Literal["gpu", "interpret", "lower"]
_MODE: contextvars.ContextVar[Mode | None] = contextvars.ContextVar("sbm_triton_mode", default=None)


@contextlib.contextmanager
def triton_mode(mode: Mode) -> Iterator[None]:
    """Run ``kernel="triton"`` in ``mode`` while the context is open (when traced).

    ``"interpret"``: Pallas interpret mode, the kernel body run as ordinary JAX on any
    backend (the CPU tests). ``"lower"``: emit the Triton kernel whatever JAX's default
    backend is, for lowering for ``cuda`` from a host without a GPU
    (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``). Outside the
    context the kernel runs compiled on a GPU and is refused elsewhere. A function
    jitted inside the context keeps the mode it was traced with.
    """
    if mode not in ("gpu", "interpret", "lower"):
        raise ValueError(f"triton_mode({mode!r}): choose 'gpu', 'interpret' or 'lower'")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def check_backend(backend: str | None = None) -> None:
    """Raise the one-line error for ``kernel='triton'`` on a backend it cannot run on."""
    if _MODE.get() is not None:
        return
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        raise ValueError(
            f"kernel='triton' needs an NVIDIA GPU, but JAX's backend is {backend!r}: use "
            "kernel='rows' there (or sbm_jax.kernels.triton.triton_mode('interpret') to "
            "test the kernel on a CPU)"
        )


def _interpret() -> bool:
    return _MODE.get() == "interpret"


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _call(cfg: _Cfg, kernel, out_shape, *args, aliases=None):
    grid = (cfg.num_virtual // cfg.block_rows,)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases or {},
        interpret=cfg.interpret,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS),
        name="sbm_edge_attention",
    )(*args)


def _tile(cfg, row_ref, start_ref, len_ref, q_ref, k_ref, cols_ref, scale_ref, bias_ref):
    """One program's virtual rows: (rows, slots, ok, cols, qb, kb, s, a)."""
    vb, r = cfg.block_rows, cfg.slots_per_row
    vs = pl.ds(pl.program_id(0) * vb, vb)
    rows, start, length = row_ref[vs], start_ref[vs], len_ref[vs]
    offs = jax.lax.broadcasted_iota(jnp.int32, (vb, r), 1)
    ok = offs < length[:, None]
    slots = jnp.where(ok, start[:, None] + offs, 0)
    c = cols_ref[slots]  # [Vb, R] gather
    f32 = jnp.float32
    qb = q_ref[rows, :].astype(f32)  # [Vb, d]
    kb = k_ref[c, :].astype(f32)  # [Vb, R, d] gather
    s = jnp.sum(qb[:, None, :] * kb, axis=2) * (1.0 / math.sqrt(cfg.head_dim))
    a = s * scale_ref[slots] if cfg.has_scale else s
    if cfg.has_bias:
        a = a + bias_ref[slots]
    return rows, slots, ok, c, qb, kb, s, a


def _forward_kernel(cfg, row_ref, start_ref, len_ref, q_ref, k_ref, v_ref, cols_ref,
                    scale_ref, bias_ref, z_ref, mx_ref, l_ref, o_ref):  # fmt: skip
    vs = pl.ds(pl.program_id(0) * cfg.block_rows, cfg.block_rows)
    _, slots, ok, c, _, _, _, a = _tile(
        cfg, row_ref, start_ref, len_ref, q_ref, k_ref, cols_ref, scale_ref, bias_ref
    )
    a = jnp.where(ok, a, -jnp.inf)
    mx = jnp.max(a, axis=1)  # -inf for an empty virtual row
    safe = jnp.where(mx > -jnp.inf, mx, 0.0)
    p = jnp.where(ok, jnp.exp(a - safe[:, None]), 0.0)
    l_ref[vs] = jnp.sum(p, axis=1)
    mx_ref[vs] = mx
    if cfg.has_dropout:
        p = p * z_ref[slots]
    vals = v_ref[c, :].astype(jnp.float32)  # [Vb, R, dv] gather
    o_ref[vs, :] = jnp.sum(p[:, :, None] * vals, axis=1)


def _atomic_rows_add(cfg, ref, idx, val, ok):
    """``ref[idx[v, r], :] += val[v, r, :]`` for the lanes ``ok``, duplicates summed."""
    if cfg.interpret:
        # Interpret mode's atomic_add at array indices keeps one update per duplicate.
        ref[...] = ref[...] + jnp.zeros(ref.shape, ref.dtype).at[idx].add(val)
    else:
        plt.atomic_add(ref.at[idx, :], (), val, mask=ok[:, :, None])


def _backward_kernel(cfg, row_ref, start_ref, len_ref, q_ref, k_ref, v_ref, cols_ref,
                     scale_ref, bias_ref, z_ref, lse_ref, dout_ref, bigd_ref,
                     dk_in, dv_in, dscale_in, dbias_in,
                     dq_ref, dk_ref, dv_ref, dscale_ref, dbias_ref):  # fmt: skip
    del dk_in, dv_in, dscale_in, dbias_in  # aliased to dk_ref, dv_ref, ...: zeros
    f32 = jnp.float32
    vs = pl.ds(pl.program_id(0) * cfg.block_rows, cfg.block_rows)
    rows, slots, ok, c, qb, kb, s, a = _tile(
        cfg, row_ref, start_ref, len_ref, q_ref, k_ref, cols_ref, scale_ref, bias_ref
    )
    w = jnp.where(ok, jnp.exp(a - lse_ref[rows][:, None]), 0.0)
    dob = dout_ref[rows, :].astype(f32)  # [Vb, dv]
    vals = v_ref[c, :].astype(f32)  # [Vb, R, dv]
    dp = jnp.sum(dob[:, None, :] * vals, axis=2)
    if cfg.has_dropout:
        zb = z_ref[slots]
        dp, wz = dp * zb, w * zb
    else:
        wz = w
    da = jnp.where(ok, w * (dp - bigd_ref[rows][:, None]), 0.0)
    inv = 1.0 / math.sqrt(cfg.head_dim)
    ds = da * scale_ref[slots] * inv if cfg.has_scale else da * inv
    # Each valid slot is in exactly one virtual row; empty lanes go to the spare slot C.
    spare = jnp.where(ok, slots, cfg.capacity)
    if cfg.has_scale:
        dscale_ref[spare] = da * s
    if cfg.has_bias:
        dbias_ref[spare] = da
    dq_ref[vs, :] = jnp.sum(ds[:, :, None] * kb, axis=1)
    _atomic_rows_add(cfg, dk_ref, c, ds[:, :, None] * qb[:, None, :], ok)
    _atomic_rows_add(cfg, dv_ref, c, wz[:, :, None] * dob[:, None, :], ok)


class _Cfg(NamedTuple):
    """Static configuration of one call (hashable: a ``custom_vjp`` nondiff argument)."""

    slots_per_row: int
    block_rows: int
    num_virtual: int
    head_dim: int  # the true d (scores are scaled by 1/sqrt(d), not by the padded one)
    capacity: int
    has_scale: bool
    has_bias: bool
    has_dropout: bool
    interpret: bool


def _merge(rows, mx, lsum, o, n):
    """Merge the virtual rows of each query (rows sorted): flash attention's block merge."""
    seg = partial(jax.ops.segment_max, num_segments=n, indices_are_sorted=True)
    row_max = seg(mx, rows)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(mx > -jnp.inf, jnp.exp(mx - row_max[rows]), 0.0)
    add = partial(jax.ops.segment_sum, num_segments=n, indices_are_sorted=True)
    denom = add(lsum * e, rows)
    acc = add(o * e[:, None], rows)
    has = denom > 0
    out = acc / jnp.where(has, denom, 1.0)[:, None]
    lse = jnp.where(has, row_max + jnp.log(jnp.where(has, denom, 1.0)), 0.0)
    return out, lse


def _forward(cfg, q, k, v, scale, bias, z, cols, blocks):
    n, dv, nv = q.shape[0], v.shape[-1], cfg.num_virtual
    f32 = jnp.float32
    out_shape = (
        jax.ShapeDtypeStruct((nv,), f32),
        jax.ShapeDtypeStruct((nv,), f32),
        jax.ShapeDtypeStruct((nv, dv), f32),
    )
    mx, lsum, o = _call(
        cfg,
        partial(_forward_kernel, cfg),
        out_shape,
        blocks.row, blocks.start, blocks.length, q, k, v, cols, scale, bias, z,
    )  # fmt: skip
    out, lse = _merge(blocks.row, mx, lsum, o, n)
    return out.astype(v.dtype), lse


def _backward(cfg, q, k, v, scale, bias, z, cols, blocks, out, lse, dout):
    n, d = q.shape
    f32 = jnp.float32
    bigd = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1)  # [n]
    dk0 = jnp.zeros(k.shape, f32)
    dv0 = jnp.zeros(v.shape, f32)
    # per-slot gradients: one spare slot past the end takes the empty lanes' stores
    ds0 = jnp.zeros((cfg.capacity + 1 if cfg.has_scale else 1,), f32)
    db0 = jnp.zeros((cfg.capacity + 1 if cfg.has_bias else 1,), f32)
    out_shape = (
        jax.ShapeDtypeStruct((cfg.num_virtual, d), f32),
        jax.ShapeDtypeStruct(dk0.shape, f32),
        jax.ShapeDtypeStruct(dv0.shape, f32),
        jax.ShapeDtypeStruct(ds0.shape, f32),
        jax.ShapeDtypeStruct(db0.shape, f32),
    )
    args = (blocks.row, blocks.start, blocks.length, q, k, v, cols, scale, bias, z, lse,
            dout, bigd, dk0, dv0, ds0, db0)  # fmt: skip
    first_acc = len(args) - 4
    aliases = {first_acc + i: 1 + i for i in range(4)}
    dq_rows, dk, dv, dscale, dbias = _call(
        cfg, partial(_backward_kernel, cfg), out_shape, *args, aliases=aliases
    )
    dq = jax.ops.segment_sum(dq_rows, blocks.row, num_segments=n, indices_are_sorted=True)
    return dq, dk, dv, dscale[: cfg.capacity], dbias[: cfg.capacity]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _triton_attention(cfg, q, k, v, scale, bias, z, cols, blocks):
    """``(out, lse)``; ``lse``'s cotangent is dropped (callers stop its gradient)."""
    return _forward(cfg, q, k, v, scale, bias, z, cols, blocks)


def _triton_fwd(cfg, q, k, v, scale, bias, z, cols, blocks):
    out, lse = _forward(cfg, q, k, v, scale, bias, z, cols, blocks)
    out_name, lse_name = EDGE_KERNEL_RESIDUAL_NAMES
    out, lse = checkpoint_name(out, out_name), checkpoint_name(lse, lse_name)
    return (out, lse), (q, k, v, scale, bias, z, cols, blocks, out, lse)


@scoped(EDGE_KERNEL)
def _triton_bwd(cfg, res, cts):
    dout, _ = cts
    q, k, v, scale, bias, z, cols, blocks, out, lse = res
    dq, dk, dv, dscale, dbias = _backward(
        cfg, q, k, v, scale, bias, z, cols, blocks, out, lse, dout
    )
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        dscale if cfg.has_scale else jnp.zeros_like(scale),
        dbias if cfg.has_bias else jnp.zeros_like(bias),
        jnp.zeros_like(z),
        None,
        jax.tree.map(lambda _: None, blocks),
    )


_triton_attention.defvjp(_triton_fwd, _triton_bwd)


def default_block_rows(slots_per_row: int, head_dim: int) -> int:
    """``Vb``: virtual rows per program, a power of two with ``Vb * R * d`` about
    :data:`TILE_ELEMENTS` (a guess until measured on a GPU; see docs/architecture.md)."""
    return _pow2_floor(max(1, TILE_ELEMENTS // (slots_per_row * _pow2_ceil(head_dim))))


def _pad_cols(x: jax.Array, width: int) -> jax.Array:
    if x.shape[-1] == width:
        return x
    return jnp.pad(x, ((0, 0), (0, width - x.shape[-1])))


@scoped(EDGE_KERNEL)
def triton_edge_attention(
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
    block_rows: int | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Same contract as :func:`sbm_jax.edge_ops.edge_attention` (``impl="triton"``).

    Args:
      q: ``[n, d]``; k: ``[m, d]``; v: ``[m, dv]``.
      edges: an EdgeList honouring the layout contract (valid edges first, row-sorted).
      edge_scale: optional ``[C]`` factor on each edge's score.
      edge_bias: optional ``[C]`` term added to each edge's logit (after the scale).
      dropout_rate, dropout_rng: attention dropout on the normalised weights; the keep
        mask is drawn over the ``C`` slots exactly as the ``rows`` kernel draws it.
      slots_per_row: ``R`` (static), rounded up to a power of two; default
        :func:`~sbm_jax.kernels.rows.default_slots_per_row`.
      block_rows: virtual rows per program ``Vb`` (static), rounded down to a power of
        two; default :func:`default_block_rows`.
      return_lse: also return the per-row log-normaliser (``[n]`` float32, 0 for a row
        without edges), under ``stop_gradient``.

    Returns:
      ``[n, dv]`` (or ``(out, lse)``); rows without a valid edge are exactly 0; empty
      slots get zero gradient.

    Raises:
      ValueError: on a backend other than a GPU, outside :func:`triton_mode`.
    """
    check_backend()
    n, d = q.shape
    edges.check_operands(n, k.shape[0], edge_scale=edge_scale, edge_bias=edge_bias)
    cap = edges.capacity
    r = default_slots_per_row(cap, n) if slots_per_row is None else int(slots_per_row)
    if r < 1:
        raise ValueError(f"slots_per_row must be >= 1, got {slots_per_row}")
    r = _pow2_ceil(r)
    vb = default_block_rows(r, d) if block_rows is None else int(block_rows)
    if vb < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    vb = _pow2_floor(min(vb, _pow2_ceil(n + -(-cap // r))))
    blocks: RowBlocks = row_blocks(edges, n, slots_per_row=r, block_rows=vb)
    has_scale, has_bias, has_dropout = (
        edge_scale is not None,
        edge_bias is not None,
        dropout_rate > 0.0 and dropout_rng is not None,
    )
    scale, bias, z = slot_terms(cap, edge_scale, edge_bias, dropout_rate, dropout_rng)
    cfg = _Cfg(
        slots_per_row=r,
        block_rows=vb,
        num_virtual=blocks.row.shape[0],
        head_dim=d,
        capacity=cap,
        has_scale=has_scale,
        has_bias=has_bias,
        has_dropout=has_dropout,
        interpret=_interpret(),
    )
    dv = v.shape[-1]
    dp, dvp = _pow2_ceil(d), _pow2_ceil(dv)
    qp, kp, vp = _pad_cols(q, dp), _pad_cols(k, dp), _pad_cols(v, dvp)
    cols = edges.cols.astype(jnp.int32)
    out, lse = _triton_attention(cfg, qp, kp, vp, scale, bias, z, cols, blocks)
    out = out[:, :dv]
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out
