"""The inverse-CDF searches of fastRG: CDFs that never decrease and stay flat across
zero weights (:func:`weight_cdf`), guide tables built by counting (:func:`_guide_table`),
and the exact guided search (:func:`_search_guided`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sbm_jax._varying import vary_like

#: Longest axis :func:`weight_cdf` sums in one sequential pass; longer ones go in blocks.
CDF_ONE_PASS = 256

#: How :func:`weight_cdf` sums: ``"scan"`` (sequential sums in ``lax.scan`` loops) or
#: ``"parallel"`` (log-depth scans, no loops). Both give CDFs that never decrease and stay
#: flat, bit for bit, across zero weights; they differ only in speed.
CDF_METHODS = ("scan", "parallel")


def cdf_method() -> str:
    """:func:`weight_cdf`'s method on the default backend: ``"scan"`` on CPU, where the
    sequential loops ran faster in the fused layer; ``"parallel"`` on GPU and TPU, where
    each of a loop's ~130-260 steps would cost the device a dependent step (on a GPU, a
    kernel launch and a predicate read back per step) for a few thousand additions
    each."""
    return "scan" if jax.default_backend() == "cpu" else "parallel"


def weight_cdf(w: jax.Array, axis: int, method: str | None = None) -> jax.Array:
    """Prefix sums of nonnegative weights ``w`` along ``axis``, as the inverse-CDF
    searches need them: nondecreasing, and flat (bit for bit) across every zero weight.

    ``jnp.cumsum`` gives neither: XLA rewrites a long cumulative sum into blocks whose
    offsets come from a second, recursive scan, so at a block boundary a prefix can round
    an ulp below the one before it, or an ulp above it across a zero weight. A padded key
    then carries mass, and at millions of draws per step it would now and then be drawn
    as an edge; and the guide tables' counting assumes a nondecreasing CDF.

    ``method`` (default :func:`cdf_method`):

    * ``"scan"``: every sum is a sequential ``c + w`` (``lax.scan``), so both properties
      hold by the monotonicity of rounding: axes up to :data:`CDF_ONE_PASS` long in one
      pass; longer ones in ``~sqrt(L)`` blocks, summed inside each block (all blocks at
      once) and offset by the sequential sum of the block totals, so the last entry of a
      block and the next block's offset are the same addition. ``L + 2 sqrt(L)`` steps'
      work in ``~2 sqrt(L)`` steps, which on CPU was faster than ``jnp.cumsum``.
    * ``"parallel"``: ``jnp.cumsum`` in whatever order the backend sums, then two exact
      fix-ups with running maxima (``lax.cummax``, no rounding): the running maximum of
      the sums makes them nondecreasing, and every entry takes the value at the last
      nonzero weight at or before it (the running maximum of those indices), so a zero
      weight repeats its predecessor exactly (leading zeros give 0). Each entry stays
      within the sums' own rounding of the exact prefix sum. Log-depth, without loops.
    """
    method = cdf_method() if method is None else method
    if method not in CDF_METHODS:
        raise ValueError(f"method={method!r} is not one of {CDF_METHODS}")
    w = jnp.moveaxis(w, axis, 0)
    out = _cdf_scan(w) if method == "scan" else _cdf_parallel(w)
    return jnp.moveaxis(out, 0, axis)


def _cdf_parallel(w: jax.Array) -> jax.Array:
    sums = jax.lax.cummax(jnp.cumsum(w, axis=0), axis=0)
    index = jax.lax.broadcasted_iota(jnp.int32, w.shape, 0)
    last = jax.lax.cummax(jnp.where(w != 0, index, -1), axis=0)
    out = jnp.take_along_axis(sums, jnp.maximum(last, 0), axis=0)
    return jnp.where(last >= 0, out, jnp.zeros_like(out))


def _cdf_scan(w: jax.Array) -> jax.Array:
    length = w.shape[0]

    def add(c, x):
        c = c + x
        return c, c

    # The carries start varying over the manual axes that w varies over (inside
    # jax.shard_map, lax.scan needs equal carry types on the way in and out).
    if length <= CDF_ONE_PASS:
        _, out = jax.lax.scan(add, vary_like(jnp.zeros(w.shape[1:], w.dtype), w), w)
        return out
    size = math.isqrt(length - 1) + 1
    blocks = -(-length // size)
    w = jnp.pad(w, [(0, blocks * size - length)] + [(0, 0)] * (w.ndim - 1))
    w = w.reshape((blocks, size) + w.shape[1:])
    init = vary_like(jnp.zeros((blocks,) + w.shape[2:], w.dtype), w)
    _, inner = jax.lax.scan(add, init, jnp.swapaxes(w, 0, 1))

    def offset(c, total):
        return c + total, c

    init = vary_like(jnp.zeros(w.shape[2:], w.dtype), w)
    _, offsets = jax.lax.scan(offset, init, inner[-1])
    out = jnp.swapaxes(offsets[None] + inner, 0, 1).reshape((blocks * size,) + w.shape[2:])
    return out[:length]


def _below(total: jax.Array, u: jax.Array) -> jax.Array:
    # u * total, kept strictly below total so the inverse CDF always lands on a
    # positive-weight entry.
    return jnp.minimum(u * total, jnp.nextafter(total, jnp.zeros_like(total)))


def _bisect_step(cdf: jax.Array, row: jax.Array, target: jax.Array):
    """One step of the batched search for the first ``j`` with ``cdf[row, j] > target``
    inside ``[lo, hi]``: ``(lo, hi) -> (lo, hi)``."""
    flat = cdf.reshape(-1)
    base = row * cdf.shape[1]

    def step(bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        right = flat.at[base + mid].get(mode="promise_in_bounds") <= target
        return jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)

    return step


def _guide_size(length: int, span: int) -> int:
    # One guide entry per ~span entries: a bracket then holds a few entries on average.
    return max(1, length // span)


#: Keys per guide-table bucket in the in-cluster key search (see :func:`_guide_table`).
#: With the bracket of three buckets in :func:`_search_guided`, 4 made fastRG faster than 8
#: with a five-bucket bracket; 2 was no faster and doubles the table.
GUIDE_SPAN = 4

#: Clusters per guide-table bucket in the per-row key-cluster search. The row CDFs are
#: short (``K = k + 1`` entries) but there is one per query row, and a plain binary search
#: over them (``ceil(log2 K)`` dependent gathers per draw) was the sampler's largest cost.
ROW_GUIDE_SPAN = 2


def _cut_points(t: jax.Array, total: jax.Array, g: int) -> jax.Array:
    # The guide's cut points t * total / G: one formula, so that the table and the
    # searches agree on them to the last bit.
    return t.astype(total.dtype) * total / g


def _guide_marks(cdf: jax.Array, span: int) -> jax.Array:
    """``[R, G + 1]`` the guide's cut points ``t * total / G`` of each row of ``cdf``."""
    g = _guide_size(cdf.shape[1], span)
    return _cut_points(jnp.arange(g + 1)[None, :], cdf[:, -1:], g)


def _guide_table(cdf: jax.Array, span: int = GUIDE_SPAN) -> jax.Array:
    """:func:`_guide_table_rows` of ``cdf`` ``[R, L]``, whose batch axes under ``vmap``
    become rows: the layer builds its plans under ``vmap`` over (example, head), and a
    batched scatter-add indexes by tuple (``[B H R L, 3]`` int32 indices, dearer to build
    than the scatter itself); one scatter over ``B H R`` rows does not.
    """
    return _guide_table_batched(span)(cdf)


@functools.cache
def _guide_table_batched(span: int):
    @jax.custom_batching.custom_vmap
    def table(cdf):
        return _guide_table_rows(cdf, span)

    @table.def_vmap
    def rule(axis_size, in_batched, cdf):
        del in_batched  # the only operand: batched whenever the rule runs
        rows = cdf.reshape(axis_size * cdf.shape[1], cdf.shape[2])
        # Calls ``table`` again, so that an outer vmap folds its axis in too.
        return table(rows).reshape(axis_size, cdf.shape[1], -1), True

    return table


def _guide_table_rows(cdf: jax.Array, span: int = GUIDE_SPAN) -> jax.Array:
    """Guide table (Chen and Asau's indexed search) of each row of ``cdf`` ``[R, L]``.

    ``table[r, t]`` is the first ``j`` with ``cdf[r, j] > t * total_r / G`` (capped at
    ``L - 1``), so the inverse CDF of a target in ``[t * total_r / G, (t + 1) * total_r /
    G)`` lies in ``[table[r, t], table[r, t + 1]]``: a bracket of ``~L / G`` entries
    instead of the whole row (``G = L / span``).

    Built by counting, in O(R (L + G)): the cut points and ``cdf`` both increase, so
    ``table[r, t] = #{j : cdf[r, j] <= cut_t}`` is a prefix sum of how many entries have
    each ``t_j``, the first cut point at or above entry ``j``. ``t_j`` is estimated as
    ``ceil(cdf_j G / total)`` and moved one step each way against the cut points
    themselves (:func:`_cut_points`), so the table equals a search for every cut point
    whenever ``total`` is a normal float32 (the estimate is then off by less than one;
    with a subnormal total, weight below 2^-126 in all, all but never drawn, it can be
    off by more, as :func:`_search_guided`'s bucket can). A batched binary search
    (``jnp.searchsorted``) and a loop stepping until every entry is exact were both
    slower.
    """
    rows, length = cdf.shape
    g = _guide_size(length, span)
    total = cdf[:, -1:]
    est = jnp.ceil(cdf * g / jnp.where(total > 0, total, 1.0))
    # Clipped after the conversion, so that even a NaN entry indexes inside the histogram.
    first = jnp.clip(est.astype(jnp.int32), 0, g + 1)
    up = (first <= g) & (_cut_points(first, total, g) < cdf)
    first = jnp.where(up, first + 1, first)
    down = (first >= 1) & (_cut_points(jnp.maximum(first - 1, 0), total, g) >= cdf)
    first = jnp.where(down, first - 1, first)
    # One histogram of t_j per row (bin G + 1: above every cut point), then prefix sums.
    # t_j does not decrease along a row, so the flat indices are sorted.
    flat = (jnp.arange(rows, dtype=jnp.int32)[:, None] * (g + 2) + first).reshape(-1)
    hist = jnp.zeros((rows * (g + 2),), jnp.int32)
    hist = hist.at[flat].add(1, indices_are_sorted=True, mode="promise_in_bounds")
    counts = _int_cumsum(hist.reshape(rows, g + 2))[:, : g + 1]
    return jnp.minimum(counts, length - 1)


#: Entries of the guide's bracket that :func:`_search_guided` reads in one contiguous
#: gather before it falls back to bisection, in the in-cluster key search. One window
#: costs one cache miss per draw. The bisection it replaces cost ~5 dependent gathers per
#: draw, each missing again, because a chunk's 16384 draws touch more cache lines than
#: L2 holds between two steps; and since the bisection runs until every bracket of a
#: chunk has closed, one long bracket costs the whole chunk its steps, so the window
#: covers the longest brackets on the benchmark's plans, not the typical one.
SEARCH_WINDOW = 32

#: The same for the per-row key-cluster search, whose brackets are shorter. Its rows are
#: sorted, so its bisection mostly hits the cache: a wider window costs more than the
#: steps it saves.
ROW_SEARCH_WINDOW = 16


def padded_cdf(cdf: jax.Array, window: int = SEARCH_WINDOW) -> jax.Array:
    """``cdf`` ``[R, L]`` with ``window`` columns of ``+inf`` appended, for
    :func:`_search_guided`: every window starting inside a row then lies inside the array.
    """
    return jnp.pad(cdf, ((0, 0), (0, window)), constant_values=jnp.inf)


def _search_guided(
    cdf: jax.Array,
    table: jax.Array,
    row: jax.Array,
    target: jax.Array,
    total: jax.Array | None = None,
    padded: jax.Array | None = None,
    window: int = SEARCH_WINDOW,
) -> jax.Array:
    """First ``j`` with ``cdf[row, j] > target`` (the inverse CDF, exact, batched over
    ``row`` and ``target``, for ``0 <= target < cdf[row, -1]``), bracketed by the guide
    ``table`` (:func:`_guide_table`). ``total``: ``cdf[row, -1]`` if the caller has it.
    ``padded``: :func:`padded_cdf` of ``cdf``, if the caller has it (a caller that
    searches one CDF in many chunks pads it once); its width sets the window, and
    ``window`` applies only without it.

    The bucket ``t = floor(target G / total)`` is computed in floating point, and the
    cut points ``t total / G`` are too, so ``t`` may be one off the bucket the table
    assigns to ``target`` (float32 rounding moves ``target G / total`` by far less than
    one bucket for any ``G`` below 2^20): the bracket spans the buckets ``t - 1`` to
    ``t + 1``. The first ``window`` entries of the bracket are read at once (one
    contiguous gather) and counted: the CDF increases, so the entries at or below the
    target are a prefix of the bracket and their count is the answer whenever it is
    short of the window. Brackets longer than that continue by binary search, which runs
    until every bracket in the batch has closed (gathering the few long brackets into a
    batch of their own first was no faster on the benchmark's layer). A row without
    weight (``total = 0``, never asked for a draw) gets a finite bracket too.
    """
    length = cdf.shape[1]
    g = table.shape[1] - 1
    total = cdf[row, -1] if total is None else total
    t = jnp.floor(target * g / jnp.where(total > 0, total, 1.0)).astype(jnp.int32)
    tflat = table.reshape(-1)
    tbase = row * (g + 1)
    lo = tflat[tbase + jnp.clip(t - 1, 0, g)]
    hi = tflat[tbase + jnp.clip(t + 2, 0, g)]
    hi = jnp.where(t + 2 > g, length - 1, hi)
    padded = padded_cdf(cdf, window) if padded is None else padded
    window = padded.shape[1] - length
    if window > 0:
        vals = jax.vmap(lambda r, j: jax.lax.dynamic_slice(padded, (r, j), (1, window))[0])(row, lo)
        inside = lo[:, None] + jnp.arange(window, dtype=lo.dtype)[None, :] < hi[:, None]
        ahead = jnp.sum(inside & (vals <= target[:, None]), axis=1, dtype=lo.dtype)
        lo = lo + ahead
        hi = jnp.where(ahead < window, lo, hi)
    step = _bisect_step(cdf, row, target)
    lo, _ = jax.lax.while_loop(lambda b: jnp.any(b[0] < b[1]), step, (lo, hi))
    return lo


def _int_cumsum(x: jax.Array) -> jax.Array:
    # Integer prefix sums along the last axis (exact in any order): a log-depth scan was
    # faster than jnp.cumsum on CPU. The float CDFs need more care: see weight_cdf.
    return jax.lax.associative_scan(jnp.add, x, axis=x.ndim - 1)
