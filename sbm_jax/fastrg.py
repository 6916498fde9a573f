"""fastRG (Rohe et al.; paper Alg. 1) under ``jit``: SBM -> EdgeList in O(edges).

The sampler works on a static number of slots (the capacity). It draws a Poisson
number of (query, key) pairs per query row (so the slots come out grouped by row),
chooses each draw's key cluster by inverse CDF over the row's ``k + 1`` cluster
weights and its key by inverse CDF inside that cluster, collapses duplicates by
sorting, and returns the edges in the layout of
:class:`sbm_jax.graph.EdgeList`. :func:`sample_edge_keys` returns the sorted edge keys
alone (what the attention layer keeps for its backward pass);
:func:`edge_probs_straight_through` gives the layer eq. 9's estimator of ``p_e``
without computing ``p_e`` (its gradient is two SpMMs with ``k`` columns).

Two edge laws are exact:

* ``poisson``: the raw fastRG law. A pair is present with probability
  ``1 - exp(-(p + delta))``.
* ``bernoulli`` (default): independent ``Bernoulli(min(1, p + delta))`` per pair, the
  paper's model (``E[M] = p``). Realised by oversampling row ``i`` at rate
  ``c_i (p + delta)`` with ``c_i = -log(1 - q_i) / q_i`` for a cheap per-row upper bound
  ``q_i >= max_j (p_ij + delta)`` and keeping each collapsed edge with probability
  ``r / (1 - exp(-c_i r))``, ``r = p + delta``. When some ``q_i`` exceeds
  :data:`BERNOULLI_MAX_BOUND` the oversampling would cost too much and the draw is made
  densely instead (still the same law).

Exploration ``delta`` is one extra cluster whose membership is 1 for every real token
and whose block entry is ``delta``: exactly ``p + delta`` on real pairs, still low rank.
Masked queries and keys get zero membership, so no edge can touch padding.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from sbm_jax._loops import shared_trip_count
from sbm_jax._pytree import PyTreeDataclass
from sbm_jax._random import uniform
from sbm_jax._scopes import PLAN, SAMPLE, STE_BACKWARD, scoped
from sbm_jax._varying import vary_like
from sbm_jax.graph import EdgeList

LAWS = ("bernoulli", "poisson")
# Above this row bound on p + delta the bernoulli oversampling factor c = -log(1-q)/q
# exceeds ~5.3 (and diverges at 1): such graphs are drawn densely instead.
BERNOULLI_MAX_BOUND = 0.995


class SamplingPlan(PyTreeDataclass):
    """Everything fastRG needs for one (query set, key set) pair, O(nk + k^2).

    Shapes: ``n`` queries, ``m`` keys, ``k`` clusters, ``K = k + 1`` with the
    exploration cluster.
    """

    y: jax.Array  # [n, K] masked query memberships, last column = q_mask (delta cluster)
    z: jax.Array  # [m, K] masked key memberships, last column = k_mask
    ys: jax.Array  # [n, k] Y S: per-edge probability is ys[i] . z[j, :k]
    # The search tables (None in a plan made with ``tables=False``; see :func:`with_tables`):
    zcdf: jax.Array | None  # [K, m] per-cluster cumulative membership of keys
    zguide: jax.Array | None  # [K, G + 1] int32: first key j with zcdf[v, j] > t * total_v / G
    row_cdf: jax.Array | None  # [n, K] per-row cumulative weights of the key clusters
    row_guide: jax.Array | None  # [n, G' + 1] int32: guide table of row_cdf (ROW_GUIDE_SPAN)
    row_rate: jax.Array  # [n] mean draws of row i: c_i sum_j (p_ij + delta)
    expected_edges: jax.Array  # [] sum of (p + delta) over all pairs
    expected_draws: jax.Array  # [] mean Poisson draw count: sum of c_i (p_ij + delta)
    oversample: jax.Array  # [n] c_i: row i is drawn at rate c_i (p_ij + delta)
    bound: jax.Array  # [] max_i q_i, the largest row bound on p + delta (bernoulli law)
    delta: jax.Array  # [] exploration probability
    q_mask: jax.Array  # [n] bool
    k_mask: jax.Array  # [m] bool


def check_law(law: str, field: str = "law") -> None:
    """Raise a ValueError naming ``field`` unless ``law`` is a known edge law."""
    if law not in LAWS:
        raise ValueError(f"{field}={law!r} is not an edge law; choose one of {LAWS}")


@scoped(PLAN)
def make_plan(
    q_memberships: jax.Array,
    block: jax.Array,
    k_memberships: jax.Array,
    *,
    delta: float | jax.Array = 0.0,
    q_mask: jax.Array | None = None,
    k_mask: jax.Array | None = None,
    law: str = "bernoulli",
    tables: bool = True,
) -> SamplingPlan:
    """Precompute fastRG's CDFs and rates. Costs O(nk + k^2) (plus O(nk^2) for Y S).

    ``tables=False`` leaves out the search tables (``zcdf``, ``zguide``, ``row_cdf``,
    ``row_guide``, four ``[n, K]``-sized arrays): the rates, bound and memberships are
    all that the draw counts and the path choice need, and :func:`with_tables` adds the
    tables later, where the graph is sampled. The layer builds its plans for every
    (example, head) at once but samples the graphs one at a time on CPU, so the tables
    then exist for one graph at a time.
    """
    check_law(law)
    n, k = q_memberships.shape
    m = k_memberships.shape[0]
    f32 = jnp.float32
    q_mask = jnp.ones((n,), bool) if q_mask is None else q_mask.astype(bool)
    k_mask = jnp.ones((m,), bool) if k_mask is None else k_mask.astype(bool)
    yq = q_memberships.astype(f32) * q_mask[:, None]
    zk = k_memberships.astype(f32) * k_mask[:, None]
    block = block.astype(f32)
    delta = jnp.asarray(delta, f32)

    y = jnp.concatenate([yq, q_mask[:, None].astype(f32)], axis=1)
    z = jnp.concatenate([zk, k_mask[:, None].astype(f32)], axis=1)
    ys = yq @ block
    # The draws are discrete: only ys and z (the per-edge probabilities) carry gradients.
    sg = jax.lax.stop_gradient
    if law == "bernoulli":
        # Per-row bound q_i >= max_j (p_ij + delta); oversampling row i by
        # c_i = -log(1 - q_i) / q_i keeps the rate matrix low rank (diag(c) Y S Z^T) and
        # costs extra draws only on the rows whose bound is high.
        row_bound = (row_max_bound(sg(ys), sg(zk)) + sg(delta)) * q_mask * jnp.any(k_mask)
        safe = jnp.clip(row_bound, 1e-6, 1.0 - 1e-7)
        oversample = jnp.where(row_bound > 1e-6, -jnp.log1p(-safe) / safe, 1.0)
        bound = jnp.max(row_bound, initial=0.0)
    else:
        bound = jnp.asarray(0.0, f32)
        oversample = jnp.ones((n,), f32)
    row_total = jnp.sum(_row_weights(ys, z, delta, q_mask), axis=1)
    row_rate = oversample * row_total
    expected = jnp.sum(row_total)

    plan = SamplingPlan(
        y=y,
        z=z,
        ys=ys,
        zcdf=None,
        zguide=None,
        row_cdf=None,
        row_guide=None,
        row_rate=row_rate,
        expected_edges=expected,
        expected_draws=jnp.sum(row_rate),
        oversample=oversample.astype(f32),
        bound=bound.astype(f32),
        delta=delta,
        q_mask=q_mask,
        k_mask=k_mask,
    )
    return with_tables(plan) if tables else plan


def _row_weights(ys: jax.Array, z: jax.Array, delta: jax.Array, q_mask: jax.Array) -> jax.Array:
    """``[n, K]``: row ``i`` draws key cluster ``v`` with weight ``(Y Sbar)_iv sum_j z_jv``
    and, inside it, key ``j`` with weight ``z_jv``: in all, pair ``(i, j)`` gets
    ``(Y Sbar Z^T)_ij = p_ij + delta``. ``Sbar`` is ``S`` with ``delta`` appended on the
    diagonal, so ``Y Sbar = [Y S, q_mask * delta]``: no second ``[n, K] x [K, K]``
    product. The draws are discrete: no gradient flows through the weights."""
    sg = jax.lax.stop_gradient
    f32 = jnp.float32
    y_sbar = jnp.concatenate([sg(ys), (q_mask * sg(delta))[:, None].astype(f32)], axis=1)
    return y_sbar * jnp.sum(sg(z), axis=0)[None, :]


@scoped(PLAN)
def with_tables(plan: SamplingPlan) -> SamplingPlan:
    """``plan`` with its search tables (per-cluster key CDFs, per-row cluster CDFs and
    their guide tables), built if :func:`make_plan` left them out (``tables=False``).

    The row CDFs' totals equal :attr:`SamplingPlan.row_rate` over the oversampling up to
    rounding (sums in another order): each search normalises by its own table's total,
    so the law is that of the weights either way.
    """
    if plan.zcdf is not None and plan.row_cdf is not None:
        return plan
    zcdf = weight_cdf(jax.lax.stop_gradient(plan.z), axis=0).T
    row_cdf = weight_cdf(_row_weights(plan.ys, plan.z, plan.delta, plan.q_mask), axis=1)
    return plan.replace(
        zcdf=zcdf,
        zguide=_guide_table(zcdf),
        row_cdf=row_cdf,
        row_guide=_guide_table(row_cdf, ROW_GUIDE_SPAN),
    )


#: Relative slack on the Cauchy-Schwarz bound, so that float32 rounding of the norms can
#: never put it below a computed ``p_ij`` (both are exact to a few ulps).
_CS_SLACK = 2.0**-16


def row_max_bound(ys: jax.Array, zk: jax.Array) -> jax.Array:
    """``[n]`` upper bound on ``max_j p_ij = max_j ys_i . zk_j`` in O((n + m) k).

    The smaller of two bounds, each exact for nonnegative memberships: the per-cluster
    maximum ``ys_i . max_j zk_j`` (tight when memberships are peaked) and Cauchy-Schwarz
    ``|ys_i| max_j |zk_j|`` (tight when every key's memberships point the same way, as
    they do early in training: on the benchmark's plans ``max_j p_ij`` is 1.2x below it
    and 3.2x below the first, so the oversampling draws ~7% fewer pairs). Masked keys
    have zero memberships and never raise either bound.
    """
    by_cluster = ys @ jnp.max(zk, axis=0)
    norm_z = jnp.sqrt(jnp.max(jnp.sum(zk * zk, axis=1)))
    by_norm = jnp.sqrt(jnp.sum(ys * ys, axis=1)) * norm_z * (1.0 + _CS_SLACK)
    return jnp.minimum(by_cluster, by_norm)


def draw_row_counts(key: jax.Array, plan: SamplingPlan) -> jax.Array:
    """Draws per query row, ``[n] int32``, independent ``Poisson(plan.row_rate)``.

    Their sum is ``Poisson(plan.expected_draws)``; passing them to :func:`sample_edge_keys`
    saves it the multinomial split of a total.
    """
    return jax.random.poisson(key, plan.row_rate).astype(jnp.int32)


def split_count(key: jax.Array, plan: SamplingPlan, count: jax.Array) -> jax.Array:
    """``count`` draws split over the rows, ``Multinomial(count, row_rate / sum)``, [n]."""
    total = jnp.sum(plan.row_rate)
    uniform = 1.0 / plan.row_rate.size
    probs = jnp.where(total > 0, plan.row_rate / jnp.maximum(total, 1e-30), uniform)
    counts = jax.random.multinomial(key, jnp.asarray(count, jnp.float32), probs)
    return counts.astype(jnp.int32)


def needs_dense(plan: SamplingPlan, law: str) -> jax.Array:
    """True where the bernoulli bound is too close to 1 for oversampling."""
    if law == "bernoulli":
        return plan.bound > BERNOULLI_MAX_BOUND
    return jnp.asarray(False)


#: Longest axis :func:`weight_cdf` sums in one sequential pass; longer ones go in blocks.
CDF_ONE_PASS = 256

#: How :func:`weight_cdf` sums: ``"scan"`` (sequential sums in ``lax.scan`` loops) or
#: ``"parallel"`` (log-depth scans, no loops). Both give CDFs that never decrease and stay
#: flat, bit for bit, across zero weights; they differ only in speed.
CDF_METHODS = ("scan", "parallel")


def cdf_method() -> str:
    """:func:`weight_cdf`'s method on the default backend: ``"scan"`` on CPU, where the
    sequential loops ran faster in the fused layer (measured on a 2-core CPU, see
    :func:`weight_cdf`); ``"parallel"`` on GPU and TPU, where each of a loop's ~130-260
    steps would cost the device a dependent step (on a GPU, a kernel launch and a
    predicate read back per step) for a few thousand additions each."""
    return "scan" if jax.default_backend() == "cpu" else "parallel"


def weight_cdf(w: jax.Array, axis: int, method: str | None = None) -> jax.Array:
    """Prefix sums of nonnegative weights ``w`` along ``axis``, as the inverse-CDF
    searches need them: nondecreasing, and flat (bit for bit) across every zero weight.

    ``jnp.cumsum`` gives neither: XLA rewrites a long cumulative sum into blocks whose
    offsets come from a second, recursive scan, so at a block boundary a prefix can round
    an ulp below the one before it, or an ulp above it across a zero weight. On plans
    with n=m=4096 and a quarter of the keys padding, ~35 padded keys per plan carried
    mass (up to 7e-8 of their cluster): at millions of draws per step, a padded key
    would now and then have been drawn as an edge, and the guide tables' counting
    assumes a nondecreasing CDF.

    ``method`` (default :func:`cdf_method`):

    * ``"scan"``: every sum is a sequential ``c + w`` (``lax.scan``), so both properties
      hold by the monotonicity of rounding: axes up to :data:`CDF_ONE_PASS` long in one
      pass; longer ones in ``~sqrt(L)`` blocks, summed inside each block (all blocks at
      once) and offset by the sequential sum of the block totals, so the last entry of a
      block and the next block's offset are the same addition. ``L + 2 sqrt(L)`` steps'
      work in ``~2 sqrt(L)`` steps: on a 2-core CPU the key CDFs of four plans at n=4096
      took 4.5 ms against ``jnp.cumsum``'s 17 ms, the row CDFs (129 clusters) 5.5
      against 7.4 (2026-11-29).
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
#: With the bracket of three buckets in :func:`_search_guided`, 4 took fastRG from ~118 to
#: ~104 ms per graph against 8 with a five-bucket bracket (n=4096, 5%, k=128, one
#: process, alternating; 2 was no faster and doubles the table).
GUIDE_SPAN = 4

#: Clusters per guide-table bucket in the per-row key-cluster search. The row CDFs are
#: short (``K = k + 1`` entries) but there is one per query row, and a plain binary search
#: over them (``ceil(log2 K)`` dependent gathers per draw) was the sampler's largest cost:
#: about 60 of 129 ms for ~839k draws at n=4096, k=128 on a 2-core x86 CPU, 13 ms with
#: this guide (2026-11-27).
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
    batched scatter-add indexes by tuple (``[B H R L, 3]`` int32 indices, built at a cost
    of 2-3x the scatter itself); one scatter over ``B H R`` rows does not.
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
    (``jnp.searchsorted``) took 2-2.6x longer on CPU; a loop stepping until every entry
    is exact, 3x longer under ``vmap``.
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
#: gather before it falls back to bisection, in the in-cluster key search. On the
#: benchmark's plans (n=4096, 5%, k=128) its brackets held 12 keys on average (p99 16,
#: max 24). One window costs one cache miss per draw. The bisection it replaces cost ~5
#: dependent gathers per draw, each missing again, because a chunk's 16384 draws touch
#: more cache lines than L2 holds between two steps; and since the bisection runs until
#: every bracket of a chunk has closed, one long bracket costs the whole chunk its
#: steps, so the window covers the longest brackets, not the typical one. Both searches,
#: 2^20 draws on one plan: 41 ms with these windows, 68 ms without (16 and 16: 64 ms).
SEARCH_WINDOW = 32

#: The same for the per-row key-cluster search (brackets of 6 clusters on average, p99
#: 11). Its rows are sorted, so its bisection mostly hits the cache: a wider window
#: costs more than the steps it saves (32: 46 ms against 41 ms above).
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


# Slots per streamed chunk in the sampler: gathering [C, k] memberships at once
# materialises ~1 KB per edge (k=128) and was ~10x slower on CPU than chunks of this
# size; the inverse-CDF searches likewise keep their bounds in cache.
EDGE_PROB_CHUNK = 4096

#: Slots per chunk of the straight-through estimator's backward pass on CPU (two
#: ``[chunk, k]`` gathers and scatter-adds): 1024 kept them in a 2-core CPU's L2 and
#: took 40-41 ms per graph against 44-45 ms at 4096 (n=4096, 5%, k=128). Accelerators,
#: where each loop step costs kernel launches, keep :data:`EDGE_PROB_CHUNK`.
STE_CHUNK = 1024


def _ste_chunk() -> int:
    return STE_CHUNK if jax.default_backend() == "cpu" else EDGE_PROB_CHUNK


#: Slots per streamed chunk of the inverse-CDF searches (no ``[C, k]`` gathers there).
SEARCH_CHUNK = 16384


def _chunked(
    fn, *arrays: jax.Array, chunk: int | None = None, count: jax.Array | None = None, fill=0
) -> jax.Array:
    """``fn`` applied elementwise-by-slot to ``[C]`` arrays, streamed in chunks.

    Same values as ``fn(*arrays)``; chunks of ``chunk`` slots (default
    :data:`EDGE_PROB_CHUNK`, for ``[chunk, k]`` gathers; :data:`SEARCH_CHUNK` for the
    searches) keep the per-slot temporaries (search bounds, gathered rows) in cache.
    ``count`` (traced): only the first ``count`` slots are needed; the chunks past them
    are skipped (a loop with a dynamic trip count) and those slots hold ``fill``. Under
    ``vmap`` the loop runs to the largest count over the graphs
    (:func:`~sbm_jax._loops.shared_trip_count`), so slots past a graph's own ``count``
    may hold ``fn``'s values instead: callers read only the first ``count``.
    """
    chunk = EDGE_PROB_CHUNK if chunk is None else chunk
    size = arrays[0].shape[0]
    if arrays[0].ndim != 1 or (size <= chunk and count is None):
        return fn(*arrays)
    chunk = min(chunk, size)
    pad = -size % chunk
    xs = tuple(jnp.pad(a, (0, pad)) for a in arrays)
    if count is None:
        blocked = tuple(a.reshape(-1, chunk) for a in xs)
        return jax.lax.map(lambda t: fn(*t), blocked).reshape(-1)[:size]
    dtype = jax.eval_shape(fn, *(jax.ShapeDtypeStruct((chunk,), a.dtype) for a in xs)).dtype
    out = vary_like(jnp.full((size + pad,), fill, dtype), xs, count)

    def step(i, out):
        part = tuple(jax.lax.dynamic_slice(a, (i * chunk,), (chunk,)) for a in xs)
        return jax.lax.dynamic_update_slice(out, fn(*part), (i * chunk,))

    live = (jnp.minimum(jnp.asarray(count, jnp.int32), size) + chunk - 1) // chunk
    return jax.lax.fori_loop(0, shared_trip_count(live), step, out)[:size]


def edge_probs(
    plan: SamplingPlan, rows: jax.Array, cols: jax.Array, count: jax.Array | None = None
) -> jax.Array:
    """``p_ij = Qhat_i S Khat_j^T`` (masked, without delta) for each (row, col).

    ``rows``, ``cols``: ``[C]`` int. Streamed in chunks of :data:`EDGE_PROB_CHUNK` slots
    (``lax.map``) so that the ``[C, k]`` gathered memberships are never materialised.
    ``count``: only the first ``count`` slots are needed (the others get 0).
    """
    k = plan.ys.shape[1]
    ys, zk = plan.ys, plan.z[:, :k]

    def dot(r, c):
        return jnp.sum(ys[r] * zk[c], axis=-1)

    return _chunked(dot, rows, cols, count=count)


@jax.custom_vjp
def edge_probs_straight_through(
    ys: jax.Array, z: jax.Array, rows: jax.Array, cols: jax.Array, valid: jax.Array
) -> jax.Array:
    """The straight-through estimator of ``p_e`` on the edges, without computing ``p_e``.

    Args:
      ys: ``[n, k]`` ``Y S`` (:attr:`SamplingPlan.ys`).
      z: ``[m, K]`` key memberships, ``K >= k`` (:attr:`SamplingPlan.z`; the columns past
        ``k``, the exploration cluster, get no gradient).
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
    ``[C, k]`` gathered tensors that autodiff of :func:`edge_probs` keeps.
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


def _keep_probability(plan: SamplingPlan, p: jax.Array, rows: jax.Array) -> jax.Array:
    r = p + plan.delta
    c = plan.oversample[rows]
    cr = c * r
    return jnp.where(cr > 1e-7, r / -jnp.expm1(-jnp.maximum(cr, 1e-7)), 1.0 / c)


#: Under the bernoulli law, the share of slots (static) for which the thinning computes
#: ``p_e``: only draws with ``u >= 1 / c_i`` need it (see :func:`_thin`).
THIN_BUDGET = 0.25


def _thin(
    plan: SamplingPlan,
    keys: jax.Array,
    keep: jax.Array,
    u: jax.Array,
    m: int,
    budget: float | None,
) -> jax.Array:
    """Bernoulli thinning: keep each collapsed draw with ``_keep_probability``.

    The keep probability ``r / (1 - exp(-c_i r))`` is at least ``1 / c_i`` for every
    ``r``, so a draw whose uniform is below ``1 / c_i`` is kept without ``p_e``. Only the
    others need the ``k``-term dot product; with ``budget`` they are gathered into
    ``ceil(budget * C)`` slots first (the full computation runs instead when more than
    that need it). ``budget=None`` computes ``p_e`` on every slot (no ``lax.cond``: under
    ``vmap`` a cond runs both branches).
    """
    capacity = keys.shape[0]
    rows = jnp.where(keep, keys // m, 0)
    cols = jnp.where(keep, keys % m, 0)
    need = keep & (u * plan.oversample[rows] >= 1.0)

    def accepted(r, c, uu, count=None):
        p = jax.lax.stop_gradient(edge_probs(plan, r, c, count))
        return uu < _keep_probability(plan, p, r)

    def everywhere(_):
        return accepted(rows, cols, u)

    if budget is None:
        return keep & (~need | everywhere(None))
    size = max(1, math.ceil(budget * capacity))

    def gathered(_):
        pos = jnp.where(need, _int_cumsum(need.astype(jnp.int32)) - 1, size)
        idx = jnp.full((size,), capacity, jnp.int32)
        idx = idx.at[pos].set(jnp.arange(capacity, dtype=jnp.int32), mode="drop")
        take = jnp.minimum(idx, capacity - 1)
        # Only the first sum(need) gathered slots are used: p_e stops there.
        ok = accepted(rows[take], cols[take], u[take], jnp.sum(need))
        return jnp.ones((capacity,), bool).at[idx].set(ok, mode="drop")

    ok = jax.lax.cond(jnp.sum(need) <= size, gathered, everywhere, None)
    return keep & (~need | ok)


def _uniform(key: jax.Array, size: int) -> jax.Array:
    # threefry makes its bits in pairs: an odd count took 5-9x longer on CPU (15.2 vs
    # 1.8 ms for ~839k floats), so draw an even count and drop the last one. JAX's own
    # uniforms here, not sbm_jax._random's (same bits): for this one array over all the
    # slots, fed to three consumers, the unrolled hash made fastRG (bernoulli) 1.03-1.05x
    # slower on CPU, with or without an optimization barrier (its rolled loop: 0.90x).
    return jax.random.uniform(key, (size + size % 2,))[:size]


def _int_cumsum(x: jax.Array) -> jax.Array:
    # Integer prefix sums along the last axis (exact in any order): a log-depth scan was
    # ~2x faster than jnp.cumsum over ~1M slots on a 2-core CPU (2.9 vs 5.3 ms). The
    # float CDFs need more care: see :func:`weight_cdf`.
    return jax.lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


def _sort_keys(keys: jax.Array) -> jax.Array:
    # Integer keys: stability is meaningless, and the unstable sort is ~10% faster.
    return jax.lax.sort(keys, is_stable=False)


def _first_occurrences(keys: jax.Array, sentinel: int) -> jax.Array:
    prev = jnp.concatenate([jnp.full((1,), -1, keys.dtype), keys[:-1]])
    return (keys != prev) & (keys != sentinel)


def _compact(keys: jax.Array, keep: jax.Array, capacity: int, sentinel: int) -> jax.Array:
    """Move the kept entries of sorted ``keys`` to the front, in order (O(C) scatter)."""
    pos = _int_cumsum(keep.astype(jnp.int32)) - 1
    out = jnp.full((capacity,), sentinel, keys.dtype)
    return out.at[jnp.where(keep, pos, capacity)].set(keys, mode="drop")


def edges_from_keys(keys: jax.Array, n: int, m: int, probs: jax.Array | None = None) -> EdgeList:
    """The :class:`EdgeList` of sorted, compacted edge keys ``row * m + col``.

    ``keys``: ``[C] int32`` as :func:`sample_edge_keys` returns them (valid keys first,
    sorted, unique; the sentinel ``n * m`` in empty slots). O(C) elementwise. ``probs``
    defaults to zeros (callers that need ``p_e`` pass :func:`edge_probs`).
    """
    sentinel = n * m
    valid = keys != sentinel
    rows = jnp.where(valid, keys // m, n - 1).astype(jnp.int32)
    cols = jnp.where(valid, keys % m, 0).astype(jnp.int32)
    if probs is None:
        probs = jnp.zeros(keys.shape, jnp.float32)
    return EdgeList(
        rows=rows,
        cols=cols,
        valid=valid,
        probs=probs,
        num_edges=jnp.sum(valid).astype(jnp.int32),
        num_rows=int(n),
        num_cols=int(m),
    )


def _edge_list(plan: SamplingPlan, keys: jax.Array, num_draws, overflow) -> EdgeList:
    n, m = plan.y.shape[0], plan.z.shape[0]
    edges = edges_from_keys(keys, n, m)
    probs = jnp.where(edges.valid, edge_probs(plan, edges.rows, edges.cols), 0.0)
    return edges.replace(
        probs=probs,
        num_draws=jnp.asarray(num_draws, jnp.int32),
        overflow=jnp.asarray(overflow, bool),
    )


def _check_size(n: int, m: int) -> None:
    if n * m >= 2**31 - 1:
        raise ValueError(
            f"queries x keys = {n} x {m} does not fit int32 edge keys; "
            "split the sequence or enable jax_enable_x64"
        )


def _slot_rows(row_counts: jax.Array, capacity: int) -> jax.Array:
    """Row of each of ``capacity`` slots when row ``i`` owns the next ``row_counts[i]``.

    ``[capacity] int32``, nondecreasing; slots past the last draw get ``n``. Row ``r``
    owns ``[ends[r-1], ends[r])``, so slot ``s`` is in row ``#{i : ends[i] <= s}``: one
    scatter of the ``n`` ends and one cumulative sum, O(n + C).
    """
    ends = jnp.cumsum(row_counts)
    marks = jnp.zeros((capacity,), jnp.int32).at[ends].add(1, mode="drop")
    return _int_cumsum(marks)


#: How many static prefixes of the slots the work after the draw (sort, duplicates,
#: thinning, compaction) chooses from when the layer samples one graph at a time: the
#: smallest that holds every draw runs (``lax.switch``), so that this work follows the
#: draws more closely than the capacity bucket does (the buckets are 4x apart: a bucket
#: may hold 4x more slots than draws). Measured on a 2-core CPU, n=4096, B=2, H=2, the
#: whole layer fwd+bwd with its defaults: at 2% density (~340k draws per graph in a
#: bucket of 1M slots) 0.88 of the time with one prefix (median of 21 per-round
#: ratios); at 5% (83% of the bucket filled) no change; compiled temp memory 205 ->
#: 195 MiB; compilation 12 -> 15 s. Four prefixes saved no more at 2% and took 18 s to
#: compile.
PREFIX_STEPS = 2
#: The prefix sizes below the capacity are multiples of this.
PREFIX_ALIGN = 8192
#: Capacities below this are not cut: sorting and thinning all of their slots costs a few
#: ms per graph, and each prefix compiles the sort, thinning and compaction once more
#: (n=1024, 5%, a bucket of 65536 slots: compilation 12 -> 19 s for no gain).
PREFIX_MIN_CAPACITY = 2**18


def prefix_sizes(capacity: int, steps: int) -> tuple[int, ...]:
    """The ``steps`` static prefix sizes (increasing, the last ``capacity``), multiples
    of :data:`PREFIX_ALIGN` below it; only ``(capacity,)`` below
    :data:`PREFIX_MIN_CAPACITY`."""
    if steps < 1:
        raise ValueError(f"prefix_steps must be >= 1, got {steps}")
    if capacity < PREFIX_MIN_CAPACITY:
        return (capacity,)
    sizes = {capacity}
    for j in range(1, steps):
        size = -(-capacity * j // steps // PREFIX_ALIGN) * PREFIX_ALIGN
        if 0 < size < capacity:
            sizes.add(size)
    return tuple(sorted(sizes))


@scoped(SAMPLE)
def sample_edge_keys(
    key: jax.Array,
    plan: SamplingPlan,
    count: jax.Array,
    *,
    capacity: int,
    law: str = "bernoulli",
    forced_keys: jax.Array | None = None,
    thin_budget: float | None = THIN_BUDGET,
    prefix_steps: int = 1,
    padded_key_cdf: jax.Array | None = None,
) -> jax.Array:
    """fastRG's draw as sorted edge keys: ``[capacity + F] int32``, ``row * m + col``.

    ``count``: the number of draws, either a total (``[]``, split over the rows by a
    multinomial) or per row (``[n]``, :func:`draw_row_counts`). Valid keys come first,
    sorted and unique; empty slots hold the sentinel ``n * m``. No gradient flows through
    the keys (the draw is discrete); :func:`edges_from_keys` turns them into an
    :class:`EdgeList`. See :func:`sample_from_plan` for the other arguments. A ``plan``
    made with ``make_plan(..., tables=False)`` gets its search tables here
    (:func:`with_tables`).

    The draws are made row by row: row ``i``'s ``count[i]`` draws fill consecutive
    slots, so the slots come out sorted by row; each picks a key cluster ``v`` by
    inverse CDF over row ``i``'s ``K`` cluster weights (:attr:`SamplingPlan.row_cdf`)
    and a key inside ``v`` by inverse CDF over the keys' memberships. Draws past
    ``capacity`` are lost (the last rows' draws). ``thin_budget``: see :func:`_thin`.

    ``prefix_steps > 1``: the sort, the duplicates, the thinning and the compaction run on
    the smallest of :func:`prefix_sizes` slots that holds every draw (the rest are
    empty), chosen by a ``lax.switch``. The same keys as ``prefix_steps=1``, bit for bit
    (the thinning's uniforms for the first ``s`` slots do not depend on how many are
    drawn under JAX's default partitionable Threefry; under the legacy
    ``jax_threefry_partitionable=False`` the law is the same, the numbers differ). For
    calls that are not under ``vmap``: there the switch would run every branch.

    ``padded_key_cdf``: :func:`padded_cdf` of ``plan.zcdf``, for a caller that samples
    several blocks of query rows against the same keys (it pads the ``[K, m]`` table
    once instead of once per block).
    """
    n, m = plan.y.shape[0], plan.z.shape[0]
    _check_size(n, m)
    plan = with_tables(plan)
    sentinel = n * m
    k_split, k_cluster, k_col, k_keep = jax.random.split(key, 4)
    count = jnp.asarray(count)
    row_counts = count if count.ndim == 1 else split_count(k_split, plan, count)
    rows = _slot_rows(row_counts.astype(jnp.int32), capacity)
    rows = jnp.minimum(rows, n - 1)
    total = jnp.sum(row_counts)
    del k_col  # (the two uniforms of a draw now come from one key per chunk)

    # (cdf, guide, cdf padded for its window) of the two searches, padded once.
    by_row = (plan.row_cdf, plan.row_guide, padded_cdf(plan.row_cdf, ROW_SEARCH_WINDOW))  # type: ignore[arg-type]
    if padded_key_cdf is None:
        padded_key_cdf = padded_cdf(plan.zcdf, SEARCH_WINDOW)  # type: ignore[arg-type]
    in_cluster = (plan.zcdf, plan.zguide, padded_key_cdf)

    def inverse_cdf(search, which, u):
        cdf, guide, padded = search
        total_w = cdf[which, -1]
        found = _search_guided(cdf, guide, which, _below(total_w, u), total_w, padded)
        return found, total_w

    def locate(slot, r):
        # Inverse CDFs: key cluster given the row, then the key inside that cluster. The
        # chunk's uniforms come from the key folded with its first slot: no [C] arrays
        # of uniforms, and none drawn for the chunks past the last draw.
        u = uniform(jax.random.fold_in(k_cluster, slot[0]), (slot.shape[0], 2))
        v, total_r = inverse_cdf(by_row, r, u[:, 0])
        cols, _ = inverse_cdf(in_cluster, v, u[:, 1])
        # A row without weight (masked, or zero memberships and no delta) never holds a
        # draw, even when a caller's counts put some there.
        active = (slot < total) & (total_r > 0)
        return jnp.where(active, r * m + cols, sentinel).astype(jnp.int32)

    slots = jnp.arange(capacity, dtype=jnp.int32)
    located = _chunked(locate, slots, rows, chunk=SEARCH_CHUNK, count=total, fill=sentinel)
    extra = 0 if forced_keys is None else forced_keys.shape[0]

    def collapse(size):
        # Slots from `size` on are empty (the draws end before): work on the prefix only.
        def run(located):
            keys = _sort_keys(located[:size])
            keep = _first_occurrences(keys, sentinel)
            if law == "bernoulli":
                keep = _thin(plan, keys, keep, _uniform(k_keep, size), m, thin_budget)
            if forced_keys is not None:
                keys = _sort_keys(jnp.concatenate([jnp.where(keep, keys, sentinel), forced_keys]))
                keep = _first_occurrences(keys, sentinel)
            out = _compact(keys, keep, size + extra, sentinel)
            return jnp.pad(out, (0, capacity - size), constant_values=sentinel)

        return run

    sizes = prefix_sizes(capacity, prefix_steps)
    if len(sizes) == 1:
        out = collapse(capacity)(located)
    else:
        needed = jnp.minimum(total, capacity)
        step = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < needed).astype(jnp.int32)
        out = jax.lax.switch(step, [collapse(size) for size in sizes], located)
    return jax.lax.stop_gradient(out)


def sample_from_plan(
    key: jax.Array,
    plan: SamplingPlan,
    count: jax.Array,
    *,
    capacity: int,
    law: str = "bernoulli",
    forced_keys: jax.Array | None = None,
) -> EdgeList:
    """fastRG with ``count`` draws into ``capacity`` slots (plus ``forced_keys`` edges).

    ``count`` is the total number of draws (``[]``, split by :func:`split_count`) or the draws per
    row (``[n]``, :func:`draw_row_counts`). ``forced_keys`` (``[F] int32``,
    ``row * m + col``, ``n * m`` for none) are edges that are always present
    (self-loops, local windows); the output then has ``capacity + F`` slots. Draws
    beyond ``capacity`` are lost and set ``overflow``.
    ``probs`` holds ``p_e`` (:func:`edge_probs`, differentiable in ``plan.ys``/``plan.z``).
    """
    keys = sample_edge_keys(key, plan, count, capacity=capacity, law=law, forced_keys=forced_keys)
    total = jnp.sum(count)
    return _edge_list(plan, keys, total, total > capacity)


def dense_probs(plan: SamplingPlan) -> jax.Array:
    """``[n, m]`` matrix ``p = Qhat S Khat^T`` (masked, without delta)."""
    k = plan.ys.shape[1]
    return plan.ys @ plan.z[:, :k].T


def sample_dense_mask(
    key: jax.Array,
    p: jax.Array,
    delta: float | jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    law: str = "bernoulli",
) -> jax.Array:
    """``[n, m]`` bool mask drawn pair by pair with the same law as the sparse sampler."""
    check_law(law)
    rate = jax.lax.stop_gradient(p + delta)
    prob = jnp.minimum(rate, 1.0) if law == "bernoulli" else -jnp.expm1(-rate)
    real = q_mask[:, None] & k_mask[None, :]
    return (uniform(key, p.shape) < prob) & real


def _dense_into_slots(key: jax.Array, plan: SamplingPlan, capacity: int, law: str) -> EdgeList:
    n, m = plan.y.shape[0], plan.z.shape[0]
    mask = sample_dense_mask(key, dense_probs(plan), plan.delta, plan.q_mask, plan.k_mask, law)
    flat = mask.reshape(-1)
    keys = jnp.arange(n * m, dtype=jnp.int32)
    total = jnp.sum(flat)
    return _edge_list(plan, _compact(keys, flat, capacity, n * m), total, total > capacity)


def sample_sbm_graph(
    key: jax.Array,
    q_memberships: jax.Array,
    block: jax.Array,
    k_memberships: jax.Array,
    *,
    capacity: int,
    delta: float = 0.0,
    q_mask: jax.Array | None = None,
    k_mask: jax.Array | None = None,
    law: str = "bernoulli",
) -> EdgeList:
    """Sample a bipartite graph from the SBM ``(Qhat [n,k], S [k,k], Khat [m,k])``.

    Args:
      key: PRNG key.
      q_memberships: ``[n, k]`` query memberships in [0, 1].
      block: ``[k, k]`` nonnegative block matrix (softmax-normalised in SBM attention).
      k_memberships: ``[m, k]`` key memberships in [0, 1].
      capacity: static number of edge slots ``C``.
      delta: exploration probability added to every real pair.
      q_mask, k_mask: ``[n]``, ``[m]`` bool, True for real tokens; masked ones get no edge.
      law: ``"bernoulli"`` (pair present w.p. ``min(1, p + delta)``) or ``"poisson"``
        (``1 - exp(-(p + delta))``).

    Returns:
      An :class:`EdgeList` with ``C`` slots; ``overflow`` is set when more edges were
      drawn than fit. Under the bernoulli law, when the bound on ``p + delta`` exceeds
      :data:`BERNOULLI_MAX_BOUND`, the graph is drawn densely (O(nm)) and compacted; under
      ``vmap`` both ways then run, so batch-level callers (the attention layer) choose
      the path outside ``vmap`` instead.
    """
    check_law(law)
    if q_memberships.ndim != 2 or k_memberships.ndim != 2 or block.ndim != 2:
        raise ValueError(
            "sample_sbm_graph expects q_memberships [n, k], block [k, k], k_memberships [m, k]; "
            f"got {q_memberships.shape}, {block.shape}, {k_memberships.shape}"
        )
    k = q_memberships.shape[1]
    if block.shape != (k, k) or k_memberships.shape[1] != k:
        raise ValueError(
            f"cluster counts disagree: q_memberships {q_memberships.shape}, block {block.shape}, "
            f"k_memberships {k_memberships.shape}"
        )
    if k < 1:
        raise ValueError(f"number of clusters k must be >= 1, got {k}")
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    capacity = int(capacity)
    if not isinstance(delta, jax.Array) and delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    n, m = q_memberships.shape[0], k_memberships.shape[0]
    _check_size(n, m)
    if q_mask is not None and q_mask.shape != (n,):
        raise ValueError(f"q_mask must have shape ({n},), got {q_mask.shape}")
    if k_mask is not None and k_mask.shape != (m,):
        raise ValueError(f"k_mask must have shape ({m},), got {k_mask.shape}")

    plan = make_plan(
        q_memberships, block, k_memberships, delta=delta, q_mask=q_mask, k_mask=k_mask, law=law
    )
    k_count, k_draw = jax.random.split(key)
    count = draw_row_counts(k_count, plan)

    def sparse(_):
        return sample_from_plan(k_draw, plan, count, capacity=capacity, law=law)

    if law == "poisson":
        return sparse(None)
    return jax.lax.cond(
        needs_dense(plan, law),
        lambda _: _dense_into_slots(k_draw, plan, capacity, law),
        sparse,
        None,
    )
