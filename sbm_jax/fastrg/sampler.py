"""fastRG's draw: per-row slots, the two inverse-CDF searches, duplicates collapsed by a
sort, bernoulli thinning, forced edges, and the edge list (:func:`sample_edge_keys`,
:func:`sample_from_plan`, :func:`sample_sbm_graph`)."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from sbm_jax._loops import shared_trip_count
from sbm_jax._random import uniform
from sbm_jax._scopes import SAMPLE, scoped
from sbm_jax._varying import vary_like
from sbm_jax.fastrg.dense_mask import dense_probs, sample_dense_mask
from sbm_jax.fastrg.plan import (
    SamplingPlan,
    check_law,
    draw_row_counts,
    make_plan,
    needs_dense,
    split_count,
    with_tables,
)
from sbm_jax.fastrg.search import (
    ROW_SEARCH_WINDOW,
    SEARCH_WINDOW,
    _below,
    _int_cumsum,
    _search_guided,
    padded_cdf,
)
from sbm_jax.graph import EdgeList

# Slots per streamed chunk in the sampler: gathering [C, k] memberships at once
# materialises ~1 KB per edge (k=128), which leaves the cache; chunks of this size stay
# in it, and the inverse-CDF searches likewise keep their bounds in cache.
EDGE_PROB_CHUNK = 4096

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
    # threefry makes its bits in pairs: an odd count took several times longer on CPU,
    # so draw an even count and drop the last one. JAX's own uniforms here, not
    # sbm_jax._random's (same bits): for this one array over all the slots, fed to three
    # consumers, the unrolled hash made fastRG slower on CPU, with or without an
    # optimization barrier.
    return jax.random.uniform(key, (size + size % 2,))[:size]


def _sort_keys(keys: jax.Array) -> jax.Array:
    # Integer keys: stability is meaningless, and the unstable sort is faster.
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
#: may hold 4x more slots than draws). Two prefixes pay for their extra compilation on
#: sparse batches; more saved no more.
PREFIX_STEPS = 2
#: The prefix sizes below the capacity are multiples of this.
PREFIX_ALIGN = 8192
#: Capacities below this are not cut: sorting and thinning all of their slots costs a few
#: ms per graph, and each prefix compiles the sort, thinning and compaction once more,
#: for no gain at these sizes.
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
