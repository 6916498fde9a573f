"""SBM attention (paper section 4): every head samples its own sparse graph.

Per head: ``S = softmax(C C^T)`` over all ``k*k`` entries (eq. 5), memberships
``Qhat = sigmoid(MLP(Q) C^T)`` and ``Khat = sigmoid(MLP(K) C^T)`` (eqs. 6-7), a graph
``M ~ SBM(Qhat, S, Khat)`` drawn by fastRG (eq. 8), and softmax attention over the
sampled edges whose scores carry the straight-through estimator of ``p`` (eq. 9).

Path choice (outside any ``vmap``, one scalar for the whole batch): the Poisson draw
counts are drawn first; the smallest capacity bucket that holds the largest count runs
under ``lax.switch``; above the largest bucket (or where the bernoulli law's bound is
too close to 1) the dense path runs, which samples the same law pair by pair, streamed
over blocks of query rows (:mod:`sbm_jax.kernels.dense`: no ``n x m`` array in the
forward or the backward pass). No edge is ever dropped unless the dense path was ruled
out by ``max_dense_elements``; then the per-call ``overflow`` stat counts the graphs
whose draws exceeded the largest bucket.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sbm_jax._scopes import MEMBERSHIPS, SAMPLE
from sbm_jax._varying import vary_like
from sbm_jax.attention._projections import (
    HEADS,
    KV,
    attention_call,
    check_fields,
    check_int,
    head_dense,
    named,
    out_dense,
)
from sbm_jax.attention.counting import SOFTMAX, edge_flops, projection_flops, projection_params
from sbm_jax.attention.registry import STATS_COLLECTION, register
from sbm_jax.edge_ops import EDGE_KERNEL_RESIDUAL_NAMES, edge_attention
from sbm_jax.fastrg import (
    BERNOULLI_MAX_BOUND,
    PREFIX_STEPS,
    THIN_BUDGET,
    SamplingPlan,
    check_law,
    edges_from_keys,
    make_plan,
    needs_dense,
    row_max_bound,
    sample_edge_keys,
)
from sbm_jax.kernels import KERNELS
from sbm_jax.kernels.cost import edge_cost as calibrated_edge_cost
from sbm_jax.kernels.cost import resolve_kernel, sparse_buckets_worth_it
from sbm_jax.kernels.dense import streamed_sbm_attention
from sbm_jax.kernels.pairs import DEFAULT_PAIR_PROBES, expected_pair_sum, with_absent_pairs
from sbm_jax.kernels.streamed import (
    StreamConfig,
    block_capacities,
    default_stream_rows,
    streamed_graphs,
)
from sbm_jax.ste import check_ste, clip_cotangent, edge_logit_terms, edge_probs_straight_through

IMPLS = ("auto", "sparse", "dense", "streamed")

#: ``max_dense_elements``' default: no limit. The dense path is streamed over query
#: blocks (O(n d) memory per graph, whatever ``batch*heads*n*m``), so only its O(n m)
#: compute grows; ruling it out loses the draws above the largest bucket. (The old
#: default, 2**31, came from when the dense path held ``[B, H, n, m]`` arrays, and cut
#: the dense path from paper presets such as LRA Text, 128 x 2 x 3072^2 pairs, which
#: then dropped most of their edges.)
NO_DENSE_LIMIT = 2**62
#: Edge kernels the sparse branches can use (``SBMAttention.kernel``); ``"fused"`` is the
#: CPU kernel that samples and attends in one native call (:mod:`sbm_jax.kernels.fused`,
#: no capacity buckets); ``"auto"`` is resolved per backend by
#: :func:`sbm_jax.kernels.cost.resolve_kernel`.
EDGE_KERNELS = ("segment", *KERNELS, "fused", "auto")


def bucket_capacities(fractions: Sequence[float], n: int, m: int) -> tuple[int, ...]:
    """Static slot counts ``ceil(f * n * m)`` for each capacity fraction ``f``."""
    return tuple(max(1, math.ceil(f * n * m)) for f in fractions)


def choose_bucket(
    counts: jax.Array, capacities: Sequence[int], force_dense: jax.Array | bool = False
) -> jax.Array:
    """Index of the smallest capacity that holds ``max(counts)``; ``len(capacities)``
    (the dense path) when none does or when ``force_dense``. One scalar for the batch."""
    caps = jnp.asarray(capacities, jnp.int32)
    idx = jnp.sum(caps < jnp.max(counts)).astype(jnp.int32)
    return jnp.where(force_dense, len(capacities), idx)


def _forced_half_width(self_loops: bool, window: int, length: int) -> int | None:
    """Forced edges are the real pairs with ``|i - j| <= half``; None when there are none.

    A window wider than the sequence forces every pair: ``half`` is capped at
    ``length - 1``, so the forced slots per row (``2 half + 1``) never exceed what a row
    can hold twice over (a larger window asked for memory for pairs that cannot exist)."""
    if window > 0:
        return min(window // 2, max(length - 1, 0))
    return 0 if self_loops else None


def _forced_per_row(self_loops: bool, window: int, length: int) -> int:
    """Forced edges per query row (the slots each sparse branch adds for them)."""
    half = _forced_half_width(self_loops, window, length)
    return 0 if half is None else 2 * half + 1


def forced_edge_keys(
    q_mask: jax.Array, k_mask: jax.Array, *, self_loops: bool, window: int
) -> jax.Array | None:
    """Keys ``row * m + col`` of the always-present edges (``n * m`` for none).

    ``window > 0`` adds every real pair with ``|i - j| <= window // 2`` (self included);
    ``self_loops`` adds ``(i, i)`` for real tokens.
    """
    n, m = q_mask.shape[0], k_mask.shape[0]
    half = _forced_half_width(self_loops, window, max(n, m))
    if half is None:
        return None
    offsets = jnp.arange(-half, half + 1)
    i = jnp.arange(n)[:, None]
    j = i + offsets[None, :]
    ok = (j >= 0) & (j < m) & q_mask[:, None] & k_mask[jnp.clip(j, 0, m - 1)]
    return jnp.where(ok, i * m + j, n * m).reshape(-1).astype(jnp.int32)


def forced_edge_mask(
    q_mask: jax.Array, k_mask: jax.Array, *, self_loops: bool, window: int
) -> jax.Array | None:
    """Dense ``[n, m]`` form of :func:`forced_edge_keys`."""
    n, m = q_mask.shape[0], k_mask.shape[0]
    half = _forced_half_width(self_loops, window, max(n, m))
    if half is None:
        return None
    dist = jnp.abs(jnp.arange(n)[:, None] - jnp.arange(m)[None, :])
    return (dist <= half) & q_mask[:, None] & k_mask[None, :]


def _real_pairs(q_mask: jax.Array, k_mask: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.sum(q_mask) * jnp.sum(k_mask), 1).astype(jnp.float32)


#: Names of the values a sparse branch keeps for its backward pass (see
#: :data:`SPARSE_BRANCH_POLICY`): the sampled edge keys and the edge kernel's output and
#: softmax statistics. Everything else (edge list, kernel layout, STE) is recomputed
#: from them in O(C); fastRG and the attention forward run once per training step. The
#: dense branch is checkpointed with the same policy: its streamed kernel tags its output
#: and log-normaliser with the same names, and it has no edge keys.
SAVED_NAMES = ("sbm_edge_keys", *EDGE_KERNEL_RESIDUAL_NAMES)
SPARSE_BRANCH_POLICY = jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES)


def _sparse_head(
    key,
    drop_key,
    plan: SamplingPlan,
    count,
    q,
    k,
    v,
    *,
    capacity,
    law,
    self_loops,
    window,
    rate,
    kernel="rows",
    thin_budget=None,
    prefix_steps=1,
    ste="paper",
    pair_probes=DEFAULT_PAIR_PROBES,
):
    n, m = plan.y.shape[0], plan.z.shape[0]
    forced = forced_edge_keys(plan.q_mask, plan.k_mask, self_loops=self_loops, window=window)
    keys = sample_edge_keys(
        key,
        plan,
        count,
        capacity=capacity,
        law=law,
        forced_keys=forced,
        thin_budget=thin_budget,
        prefix_steps=prefix_steps,
    )
    keys = checkpoint_name(keys, "sbm_edge_keys")
    edges = edges_from_keys(keys, n, m)
    real = _real_pairs(plan.q_mask, plan.k_mask)
    # M_ste = straight_through(p_e) without p_e: ones forward, SpMM backward into ys and z;
    # the released code's estimator clips its cotangent (attention + density) first.
    m_ste = edge_probs_straight_through(plan.ys, plan.z, edges.rows, edges.cols, edges.valid)
    if ste == "reference":
        m_ste = clip_cotangent(m_ste)
    out = edge_attention(
        q,
        k,
        v,
        edges,
        **edge_logit_terms(m_ste, ste),
        dropout_rate=rate,
        dropout_rng=drop_key,
        impl=kernel,
        return_lse=ste == "pairs",
    )
    if ste == "pairs":
        # Absent pairs, estimated from probe keys per row (sbm_jax.kernels.pairs), and the
        # count's cotangent on every real pair (the gradient of the expected count).
        out, lse = out
        out, num = with_absent_pairs(
            jax.random.fold_in(key, 1), q, k, v, out, lse, plan.ys, plan.z, keys,
            plan.q_mask, plan.k_mask, probes=pair_probes,
        )  # fmt: skip
        density = num / real
    else:
        density = jnp.sum(jnp.where(edges.valid, m_ste, 0.0)) / real
    return out, density, edges.num_edges, jnp.sum(count) > capacity


def _dense_head(
    key, drop_key, plan: SamplingPlan, count, q, k, v, *, law, self_loops, window, rate, ste
):
    # Streamed over blocks of query rows: p, mask, scores and weights exist one block at
    # a time, forward and backward (sbm_jax.kernels.dense).
    del count
    kc = plan.ys.shape[1]
    out, num = streamed_sbm_attention(
        key,
        q,
        k,
        v,
        plan.ys,
        plan.z[:, :kc],
        plan.q_mask,
        plan.k_mask,
        plan.delta,
        law=law,
        ste=ste,
        forced_half=_forced_half_width(self_loops, window, q.shape[-2]),
        dropout_rate=rate,
        dropout_rng=drop_key if rate > 0.0 else None,
    )
    density = num / _real_pairs(plan.q_mask, plan.k_mask)
    edges = jax.lax.stop_gradient(num).astype(jnp.int32)
    # (never overflows; varying like the rest inside jax.shard_map, as the switch needs)
    return out, density, edges, vary_like(jnp.asarray(False), num)


def _over_batch_and_heads(fn):
    # fn(key, drop_key, plan, count, q, k, v) per (example, head); inputs carry [B, H].
    return jax.vmap(jax.vmap(fn))


def sparse_heads_per_step(backend: str | None = None) -> int | None:
    """How many (example, head) graphs a sparse branch processes at once.

    ``None`` (all of them, one ``vmap``) on accelerators, which want wide batched
    gathers; ``1`` on CPU, where a ``vmap`` over heads multiplies every streamed block's
    temporaries by ``B*H`` and pushes them out of cache: measured on a 2-core x86 CPU
    (n=2048, B*H=4, capacity n^2/16, fwd+bwd), the ``rows`` kernel took 246 ms under
    ``vmap`` and 114 ms one head at a time, fastRG 276 ms and 202 ms.
    """
    backend = jax.default_backend() if backend is None else backend
    return 1 if backend == "cpu" else None


def sampler_options(heads_per_step: int | None) -> dict[str, Any]:
    """The options of :func:`~sbm_jax.fastrg.sample_edge_keys` for graphs sampled
    ``heads_per_step`` at a time (:func:`sparse_heads_per_step`). One at a time, the
    thinning's ``lax.cond`` and the prefix ``lax.switch`` really skip work; under
    ``vmap`` (any batch of graphs) they would run every branch, so ``p_e`` is computed on
    every slot and the sort runs on all of them."""
    one_at_a_time = heads_per_step == 1
    return dict(
        thin_budget=THIN_BUDGET if one_at_a_time else None,
        prefix_steps=PREFIX_STEPS if one_at_a_time else 1,
    )


def map_over_heads(fn, heads_per_step: int | None):
    """Like :func:`_over_batch_and_heads`, but ``heads_per_step`` (example, head) pairs
    at a time (``lax.map`` over the flattened ``B*H`` axis); ``None`` = all (``vmap``)."""
    if heads_per_step is None:
        return _over_batch_and_heads(fn)

    def run(*operands):
        batch, heads = operands[-1].shape[:2]  # v: [B, H, L, d]
        flat = jax.tree.map(lambda a: a.reshape(batch * heads, *a.shape[2:]), operands)
        # batch_size=1 would wrap fn in a vmap of one, under which a lax.cond runs both
        # branches (the sampler's thinning relies on a real cond): map unbatched instead.
        size = None if heads_per_step == 1 else heads_per_step
        out = jax.lax.map(lambda ops: fn(*ops), flat, batch_size=size)
        return jax.tree.map(lambda a: a.reshape(batch, heads, *a.shape[1:]), out)

    return run


def plan_paths(
    *,
    batch: int,
    heads: int,
    length: int,
    capacity_buckets: Sequence[float],
    impl: str = "auto",
    kernel: str = "rows",
    dense_below: int = 0,
    edge_cost: float | None = None,
    max_dense_elements: int = NO_DENSE_LIMIT,
    max_edge_slots: int = 2**26,
    forced_per_row: int = 0,
    backend: str | None = None,
) -> tuple[tuple[int, ...], bool]:
    """Static path choice: ``(sparse capacities compiled, dense branch compiled)``.

    ``impl="dense"`` compiles the dense branch only; ``"sparse"`` every bucket (and the
    dense branch above them); ``"auto"`` also drops the buckets the cost model
    (:func:`sbm_jax.kernels.cost.sparse_buckets_worth_it`, ``edge_cost`` overriding its
    calibration) says cost more than the dense branch, and runs sequences with
    ``n*m <= dense_below`` dense. The dense branch is compiled only when
    ``batch*heads*n*m <= max_dense_elements``; a sparse bucket only when its slots over
    the batch, ``batch*heads*(capacity + forced_per_row*n)``, are at most
    ``max_edge_slots`` (a lax.switch reserves its largest branch's memory, ~20-30
    bytes per slot) and ``n*m`` fits the int32 edge keys.

    Raises a ValueError naming the fields and the sizes they would need, before anything
    is compiled, when no path is left.
    """
    n = m = length
    pairs = batch * heads * n * m
    dense_allowed = pairs <= max_dense_elements
    dense_hint = (
        f"max_dense_elements={max_dense_elements} rules out the dense path, which needs "
        f"max_dense_elements >= batch*heads*n*m = {pairs}"
    )
    if impl == "dense":
        if not dense_allowed:
            raise ValueError(f"impl='dense': {dense_hint}; raise it, or use impl='auto'")
        return (), True
    if n * m >= 2**31 - 1:  # sparse edge keys row * m + col are int32
        if not dense_allowed:
            raise ValueError(
                f"length={length}: the sparse buckets' int32 edge keys need n*m < 2**31 - 1 "
                f"(n*m = {n * m}), and {dense_hint}: raise max_dense_elements or shorten "
                "the sequence"
            )
        return (), True
    all_caps = bucket_capacities(capacity_buckets, n, m)
    caps = tuple(c for c in all_caps if batch * heads * (c + forced_per_row * n) <= max_edge_slots)
    if not caps and not dense_allowed:
        need = batch * heads * (all_caps[0] + forced_per_row * n)
        raise ValueError(
            f"no path fits batch={batch}, length={length}: the smallest sparse bucket "
            f"(capacity_buckets[0]={capacity_buckets[0]}) needs batch*heads*slots = {need} "
            f"slots, over max_edge_slots={max_edge_slots}, and {dense_hint}; raise "
            "max_edge_slots or max_dense_elements, or lower the batch or the length"
        )
    if impl == "auto" and dense_allowed:
        if n * m <= dense_below:
            return (), True
        # a branch holds its bucket's slots plus the forced (window, self-loop) edges of
        # every row; the dense branch gets those for free in its mask
        worth = sparse_buckets_worth_it(
            tuple(c + forced_per_row * n for c in caps),
            n,
            m,
            kernel=kernel,
            backend=backend,
            slot_cost=edge_cost,
        )
        caps = tuple(c for c, ok in zip(caps, worth, strict=True) if ok)
    return caps, dense_allowed


def plan_stream(
    *,
    batch: int,
    heads: int,
    length: int,
    capacity_buckets: Sequence[float],
    stream_rows: int = 0,
    stream_slots: int = 0,
    kernel: str = "rows",
    edge_cost: float | None = None,
    max_dense_elements: int = NO_DENSE_LIMIT,
    max_edge_slots: int = 2**26,
    forced_per_row: int = 0,
    backend: str | None = None,
) -> tuple[int, tuple[int, ...], bool]:
    """Static plan of ``impl="streamed"``: ``(block rows, per-block buffers, dense blocks)``.

    ``stream_rows`` query rows per block (0: :func:`default_stream_rows`, ``bq * m``
    near 2^20); the buffers are ``capacity_buckets``' fractions of a block's ``bq * m``
    pairs, or the one buffer ``stream_slots`` when it is set, less those over
    ``max_edge_slots`` or (with the cost model, ``edge_cost`` overriding its calibration)
    dearer than the dense path on the block's rows. A block whose draws exceed the
    largest buffer runs dense, unless ``batch*heads*n*m > max_dense_elements`` rules the
    dense path out (then those draws are lost and ``overflow`` says so).

    Raises a ValueError naming the field, before anything is compiled, when
    ``stream_slots`` cannot hold one draw per row of a block (every block would run
    dense) or when no path is left.
    """
    n = m = length
    bq = default_stream_rows(n, m) if stream_rows == 0 else int(stream_rows)
    bq = min(bq, max(1, n))
    if bq * m >= 2**31 - 1:
        raise ValueError(
            f"stream_rows={stream_rows}: a block's int32 edge keys need rows * length < "
            f"2**31 - 1 (here {bq} * {m}); lower stream_rows"
        )
    if stream_slots:
        if stream_slots < bq:
            raise ValueError(
                f"stream_slots={stream_slots} is too small for a block of {bq} query rows "
                f"(stream_rows={stream_rows}, 0 = automatic): it must hold at least one draw "
                "per row, or every block would run dense"
            )
        caps = (int(stream_slots),)
    else:
        caps = block_capacities(capacity_buckets, bq, m)  # type: ignore[assignment]
    dense_allowed = batch * heads * n * m <= max_dense_elements
    caps = tuple(c for c in caps if c + forced_per_row * bq <= max_edge_slots)  # type: ignore[assignment]
    if dense_allowed:
        worth = sparse_buckets_worth_it(
            tuple(c + forced_per_row * bq for c in caps),
            bq,
            m,
            kernel=kernel,
            backend=backend,
            slot_cost=edge_cost,
        )
        caps = tuple(c for c, ok in zip(caps, worth, strict=True) if ok)  # type: ignore[assignment]
    if not caps and not dense_allowed:
        raise ValueError(
            f"impl='streamed': no block buffer fits max_edge_slots={max_edge_slots} and "
            f"max_dense_elements={max_dense_elements} rules out the dense blocks "
            f"(batch*heads*n*m = {batch * heads * n * m}); raise one of them"
        )
    return bq, caps, dense_allowed


def sbm_attention_core(
    rng: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_memberships: jax.Array,
    block: jax.Array,
    k_memberships: jax.Array,
    mask: jax.Array,
    *,
    delta: float | jax.Array,
    law: str = "bernoulli",
    capacity_buckets: Sequence[float] = (1 / 64, 1 / 16, 1 / 4),
    impl: str = "auto",
    self_loops: bool = False,
    window: int = 0,
    dense_below: int = 0,
    edge_cost: float | None = None,
    max_dense_elements: int = NO_DENSE_LIMIT,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    kernel: str = "rows",
    ste: str = "paper",
    max_edge_slots: int = 2**26,
    pair_probes: int = DEFAULT_PAIR_PROBES,
    stream_rows: int = 0,
    stream_slots: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sample one graph per (example, head) and attend over it. Pure function.

    Shapes: ``q, k, v [B, H, L, d]``, ``q_memberships, k_memberships [B, H, L, k]``,
    ``block [H, k, k]``, ``mask [B, L]`` bool. Returns ``out [B, H, L, d]`` and stats:
    ``density [B, H]`` (differentiable through the estimator ``ste``), ``edges [B, H]``,
    ``overflow [B, H]`` bool (that graph's draws exceeded the largest bucket, so edges
    were lost: only possible when ``max_dense_elements`` rules out the dense path),
    ``path []`` (bucket index into ``capacity_buckets``; ``len(capacity_buckets)`` = the
    dense path). See :func:`plan_paths` for the static path choice; ``impl="streamed"``
    walks each graph in blocks of query rows instead (:func:`plan_stream`,
    :mod:`sbm_jax.kernels.streamed`; ``stream_rows``, ``stream_slots``), and ``path`` is
    then the largest per-block buffer index any block used.

    The body runs under one ``jax.jit`` (the options above are its static arguments):
    called eagerly, as ``model.init`` and ``model.apply`` are in a notebook, it then
    compiles as one program instead of several hundred single operations (on CPU,
    ``SBMAttention.init`` at n=64 took 24 s op by op, 6 s as one program). Under an
    outer ``jit`` it is inlined like any other function.
    """
    check_law(law)
    check_ste(ste)
    kernel = resolve_kernel(kernel)  # "auto"; a GPU-only kernel refused elsewhere
    return _sbm_attention_core(
        rng,
        q,
        k,
        v,
        q_memberships,
        block,
        k_memberships,
        mask,
        delta=delta,
        dropout_rng=dropout_rng,
        law=law,
        capacity_buckets=tuple(float(c) for c in capacity_buckets),
        impl=impl,
        self_loops=bool(self_loops),
        window=int(window),
        dense_below=int(dense_below),
        edge_cost=None if edge_cost is None else float(edge_cost),
        max_dense_elements=int(max_dense_elements),
        dropout_rate=float(dropout_rate),
        kernel=kernel,
        ste=ste,
        max_edge_slots=int(max_edge_slots),
        pair_probes=int(pair_probes),
        stream_rows=int(stream_rows),
        stream_slots=int(stream_slots),
    )


_CORE_STATIC = (
    "law",
    "capacity_buckets",
    "impl",
    "self_loops",
    "window",
    "dense_below",
    "edge_cost",
    "max_dense_elements",
    "dropout_rate",
    "kernel",
    "ste",
    "max_edge_slots",
    "pair_probes",
    "stream_rows",
    "stream_slots",
)


@partial(jax.jit, static_argnames=_CORE_STATIC)
def _sbm_attention_core(
    rng: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_memberships: jax.Array,
    block: jax.Array,
    k_memberships: jax.Array,
    mask: jax.Array,
    *,
    delta: float | jax.Array,
    dropout_rng: jax.Array | None,
    law: str,
    capacity_buckets: tuple[float, ...],
    impl: str,
    self_loops: bool,
    window: int,
    dense_below: int,
    edge_cost: float | None,
    max_dense_elements: int,
    dropout_rate: float,
    kernel: str,
    ste: str,
    max_edge_slots: int,
    pair_probes: int,
    stream_rows: int,
    stream_slots: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    batch, heads, length, _ = q.shape
    all_caps = bucket_capacities(capacity_buckets, length, length)
    dense_index = len(all_caps)  # the recorded path of the dense branch
    if kernel == "fused" and impl in ("auto", "sparse"):
        return _fused_core(
            rng, q, k, v, q_memberships, block, k_memberships, mask,
            delta=delta, dropout_rng=dropout_rng, law=law, impl=impl,
            self_loops=self_loops, window=window, dense_below=dense_below,
            edge_cost=edge_cost, max_dense_elements=max_dense_elements,
            dropout_rate=dropout_rate, ste=ste, pair_probes=pair_probes,
            dense_index=dense_index,
        )  # fmt: skip
    if impl == "streamed":
        return _streamed_core(
            rng, q, k, v, q_memberships, block, k_memberships, mask,
            delta=delta, dropout_rng=dropout_rng, law=law,
            capacity_buckets=capacity_buckets, self_loops=self_loops, window=window,
            edge_cost=edge_cost, max_dense_elements=max_dense_elements,
            dropout_rate=dropout_rate, kernel=kernel, ste=ste,
            max_edge_slots=max_edge_slots, pair_probes=pair_probes,
            stream_rows=stream_rows, stream_slots=stream_slots,
        )  # fmt: skip
    if kernel == "fused":  # impl="dense": the dense path alone, which has no edge kernel
        kernel = "rows"
    caps, dense_allowed = plan_paths(
        batch=batch,
        heads=heads,
        length=length,
        capacity_buckets=capacity_buckets,
        impl=impl,
        kernel=kernel,
        dense_below=dense_below,
        edge_cost=edge_cost,
        max_dense_elements=max_dense_elements,
        max_edge_slots=max_edge_slots,
        forced_per_row=_forced_per_row(self_loops, window, length),
    )

    def plan_one(qm, blk, km, qmask, kmask):
        # No search tables here: each sparse head builds its own graph's (with_tables),
        # so that on CPU, where the heads run one at a time, they exist for one graph at
        # a time, not for all B*H of them across the sampling.
        return make_plan(
            qm, blk, km, delta=delta, q_mask=qmask, k_mask=kmask, law=law, tables=False
        )

    # The block matrix broadcast over the batch, as in the layer: Y S is then a product
    # batched over (b, h) on both sides, with no transpose of Y around it.
    per_example = jnp.broadcast_to(block, (batch, *block.shape))
    plans = jax.vmap(jax.vmap(plan_one, in_axes=(0, 0, 0, None, None)))(
        q_memberships, per_example, k_memberships, mask, mask
    )

    k_count, k_sample = jax.random.split(rng)
    sample_keys = jax.random.split(k_sample, (batch, heads))
    if dropout_rng is not None and dropout_rate > 0.0:
        drop_keys = jax.random.split(dropout_rng, (batch, heads))
        rate = dropout_rate
    else:
        drop_keys = sample_keys  # unused when rate == 0
        rate = 0.0
    common = dict(law=law, self_loops=self_loops, window=window, rate=rate, ste=ste)
    per_step = sparse_heads_per_step()
    dense_fn = map_over_heads(partial(_dense_head, **common), per_step)  # type: ignore[arg-type]

    if not caps:  # the dense path only
        # Draws per query row are not needed: the dense path draws pair by pair.
        row_counts = jnp.zeros(plans.row_rate.shape, jnp.int32)
        operands = (sample_keys, drop_keys, plans, row_counts, q, k, v)
        out, density, edges, overflow = dense_fn(*operands)
        path = jnp.asarray(dense_index, jnp.int32)
    else:
        # Draws per query row ([B, H, n]): the sampler fills its slots row by row.
        with jax.named_scope(SAMPLE):
            row_counts = jax.random.poisson(k_count, plans.row_rate).astype(jnp.int32)
        counts = jnp.sum(row_counts, axis=-1)
        operands = (sample_keys, drop_keys, plans, row_counts, q, k, v)
        sampling = sampler_options(per_step)

        # Checkpointed per head *and* per branch. Per head: the scan over heads keeps
        # only each head's sampled keys (and the kernel's output and log-normaliser), and
        # the backward pass rebuilds a head's edge list inside that head's iteration;
        # with the branch-level checkpoint alone, the rematerialised scan stacked every
        # head's [C] residuals (edge list, layout) over the heads. Per branch: the switch
        # then carries only the named values. Measured at n=4096, 5% (B=2, H=2, fwd+bwd,
        # CPU): 0.80 -> 0.68 of the full layer's time; n=32768, 1%, B=1: temp 1.74 ->
        # 1.43 GiB.
        def branch(c):
            head = partial(
                _sparse_head,
                capacity=c,
                kernel=kernel,
                pair_probes=pair_probes,
                **sampling,
                **common,
            )
            per_head = jax.checkpoint(head, policy=SPARSE_BRANCH_POLICY)
            return jax.checkpoint(map_over_heads(per_head, per_step), policy=SPARSE_BRANCH_POLICY)

        branches = [branch(c) for c in caps]
        force_dense = jnp.any(needs_dense(plans, law))
        path = choose_bucket(counts, caps, force_dense)  # caps are a prefix of the buckets
        if dense_allowed:
            # Checkpointed too, keeping only the streamed kernel's output and
            # log-normaliser (tagged like the edge kernels'), so that the backward pass
            # does not run its forward again. Without it the switch carried the dense
            # path's own stacked residuals ([B*H, n, k] Y S and Z among them), and every
            # sparse branch had to fill them with zeros: lax.switch gives each branch
            # the union of all branches' residuals. Same outputs and gradients bit for
            # bit; compiled temp, B=2, H=2: n=4096 5% 172.3 -> 137.2 MiB, n=1024 38.0
            # -> 32.5, density 0.9 at n=2048 73.1 -> 62.1.
            branches.append(jax.checkpoint(dense_fn, policy=SPARSE_BRANCH_POLICY))
        else:
            path = jnp.minimum(path, len(caps) - 1)
        out, density, edges, overflow = jax.lax.switch(
            path, [lambda ops, f=f: f(*ops) for f in branches], operands
        )
    path = jnp.where(path == len(caps), dense_index, path)
    stats = {"density": density, "edges": edges, "overflow": overflow, "path": path}
    return out, stats


def _streamed_core(
    rng, q, k, v, q_memberships, block, k_memberships, mask, *, delta, dropout_rng, law,
    capacity_buckets, self_loops, window, edge_cost, max_dense_elements, dropout_rate,
    kernel, ste, max_edge_slots, pair_probes, stream_rows, stream_slots,
):  # fmt: skip
    """``impl="streamed"``: every graph walked in blocks of query rows, each block drawn
    into a small buffer and drawn again in the backward pass (:mod:`sbm_jax.kernels.streamed`).
    Same plans, row counts and keys as the bucketed path up to the per-block folding."""
    batch, heads, length, _ = q.shape
    bq, caps, dense_allowed = plan_stream(
        batch=batch,
        heads=heads,
        length=length,
        capacity_buckets=capacity_buckets,
        stream_rows=stream_rows,
        stream_slots=stream_slots,
        kernel="rows" if kernel in ("segment", "fused") else kernel,
        edge_cost=edge_cost,
        max_dense_elements=max_dense_elements,
        max_edge_slots=max_edge_slots,
        forced_per_row=_forced_per_row(self_loops, window, length),
    )

    def plan_one(qm, blk, km, qmask, kmask):
        return make_plan(
            qm, blk, km, delta=delta, q_mask=qmask, k_mask=kmask, law=law, tables=False
        )

    per_example = jnp.broadcast_to(block, (batch, *block.shape))
    plans = jax.vmap(jax.vmap(plan_one, in_axes=(0, 0, 0, None, None)))(
        q_memberships, per_example, k_memberships, mask, mask
    )
    k_count, k_sample = jax.random.split(rng)
    sample_keys = jax.random.split(k_sample, (batch, heads))
    rate = dropout_rate if dropout_rng is not None and dropout_rate > 0.0 else 0.0
    drop_keys = jax.random.split(dropout_rng, (batch, heads)) if rate > 0.0 else sample_keys
    with jax.named_scope(SAMPLE):
        row_counts = jax.random.poisson(k_count, plans.row_rate).astype(jnp.int32)
    force_dense = jax.vmap(jax.vmap(lambda p: needs_dense(p, law)))(plans)
    half = _forced_half_width(self_loops, window, length)
    cfg = StreamConfig(
        block_rows=bq,
        capacities=caps,
        dense=dense_allowed,
        law=law,
        ste=ste,
        forced_half=-1 if half is None else half,
        dropout_rate=rate,
        pair_probes=pair_probes,
        thin_budget=THIN_BUDGET,
    )
    # One graph at a time on every backend: each block's lax.switch must really skip the
    # branches it does not take (under vmap every branch would run).
    run = map_over_heads(streamed_graphs(cfg), 1)
    out, density_num, edges, overflow, path = run(
        sample_keys, drop_keys, plans, row_counts, force_dense, q, k, v
    )
    density = density_num / jax.vmap(jax.vmap(lambda p: _real_pairs(p.q_mask, p.k_mask)))(plans)
    # The recorded path: the largest buffer any block used, len(capacity_buckets) for dense.
    dense_index = len(capacity_buckets)
    path = jnp.max(path)
    path = jnp.where(path >= len(caps), dense_index, path)
    stats = {"density": density, "edges": edges, "overflow": overflow, "path": path}
    return out, stats


def fused_draws(
    rng: jax.Array,
    ys: jax.Array,
    zk: jax.Array,
    mask: jax.Array,
    delta: jax.Array,
    law: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused path's sampling plan without search tables: ``(oversample, counts,
    bound)``, ``[B, H, n]``, ``[B, H, n]`` int32 and ``[B, H]``.

    ``ys [B, H, n, k]`` (``Y S``, padded queries zero), ``zk [B, H, m, k]`` (padded keys
    zero), ``mask [B, L]``. Row ``i`` draws ``Poisson(c_i sum_j (p_ij + delta))`` times
    (:func:`sbm_jax.fastrg.make_plan`'s ``row_rate``), with the bernoulli law's per-row
    oversampling ``c_i`` from the row bound ``q_i`` (:func:`~sbm_jax.fastrg.row_max_bound`
    plus ``delta``; 1 under the poisson law). Everything is under ``stop_gradient``."""
    f32 = jnp.float32
    sg = jax.lax.stop_gradient
    ys, zk = sg(ys), sg(zk)
    real = mask.astype(f32)[:, None, :]  # [B, 1, L]
    m_real = jnp.sum(real, axis=-1, keepdims=True)  # [B, 1, 1]
    hi = jax.lax.Precision.HIGHEST
    zsum = jnp.sum(zk, axis=2)  # [B, H, k]
    row_total = (jnp.einsum("bhik,bhk->bhi", ys, zsum, precision=hi) + delta * m_real) * real
    if law == "bernoulli":
        bound = jax.vmap(jax.vmap(row_max_bound))(ys, zk)
        row_bound = (bound + delta) * real * (m_real > 0)
        safe = jnp.clip(row_bound, 1e-6, 1.0 - 1e-7)
        oversample = jnp.where(row_bound > 1e-6, -jnp.log1p(-safe) / safe, 1.0)
        graph_bound = jnp.max(row_bound, axis=-1)
    else:
        oversample = jnp.ones(row_total.shape, f32)
        graph_bound = jnp.zeros(row_total.shape[:2], f32)
    counts = jax.random.poisson(rng, oversample * row_total).astype(jnp.int32)
    return oversample.astype(f32), counts, graph_bound


def _fused_core(
    rng, q, k, v, q_memberships, block, k_memberships, mask, *, delta, dropout_rng, law, impl,
    self_loops, window, dense_below, edge_cost, max_dense_elements, dropout_rate, ste,
    pair_probes, dense_index,
):  # fmt: skip
    """``kernel="fused"``: every graph sampled and attended in one native call per pass
    (:mod:`sbm_jax.kernels.fused`), or, per batch, the dense path where the draws would
    cost more than it (``impl="auto"``, the cost model of :mod:`sbm_jax.kernels.cost`) or
    where the bernoulli bound is above :data:`~sbm_jax.fastrg.BERNOULLI_MAX_BOUND`. No
    capacity: memory follows neither the draws nor a bucket, and no draw is ever lost."""
    from sbm_jax.kernels.fused import FusedConfig, default_threads, fused_sbm_attention

    batch, heads, length, _ = q.shape
    n = m = length
    f32 = jnp.float32
    real = mask.astype(f32)[:, None, :, None]
    yq = q_memberships.astype(f32) * real
    zk = k_memberships.astype(f32) * real
    ys = jnp.einsum("bhik,hkl->bhil", yq, block.astype(f32))
    delta = jnp.asarray(delta, f32)
    k_count, k_sample = jax.random.split(rng)
    with jax.named_scope(SAMPLE):
        oversample, counts, bound = fused_draws(k_count, ys, zk, mask, delta, law)
    sample_keys = jax.random.split(k_sample, (batch, heads))
    bits = jax.vmap(jax.vmap(lambda kk: jax.random.bits(kk, (2,), jnp.uint32)))
    seeds = bits(sample_keys)
    rate = dropout_rate if dropout_rng is not None and dropout_rate > 0.0 else 0.0
    drop_keys = jax.random.split(dropout_rng, (batch, heads)) if rate > 0.0 else sample_keys
    drop_seeds = bits(drop_keys) if rate > 0.0 else seeds
    half = _forced_half_width(self_loops, window, length)
    masks = jnp.broadcast_to(mask[:, None, :], (batch, heads, length))
    deltas = jnp.broadcast_to(delta, (batch, heads))
    real_pairs = jnp.maximum(jnp.sum(mask, -1) ** 2, 1).astype(f32)[:, None]  # [B, 1]

    def fused_branch(ops):
        q, k, v, ys, zk, oversample, counts = ops
        cfg = FusedConfig(
            law=law,
            forced_half=-1 if half is None else half,
            dropout_rate=rate,
            ste=ste,
            probes=pair_probes,
            threads=default_threads(),
        )
        out, num, edges = fused_sbm_attention(
            cfg, seeds, drop_seeds, q, k, v, ys, zk, oversample, counts, masks, masks, deltas
        )
        if ste == "pairs":  # the count's cotangent on every real pair (closed form)
            pair_sum = jax.vmap(jax.vmap(expected_pair_sum))(ys, zk, masks, masks)
            num = num + pair_sum - jax.lax.stop_gradient(pair_sum)
        return out, num / real_pairs, edges

    def dense_branch(ops):
        q, k, v, ys, zk, _, _ = ops

        def head(key, drop_key, q, k, v, ys, zk, qm, dl):
            out, num = streamed_sbm_attention(
                key, q, k, v, ys, zk, qm, qm, dl, law=law, ste=ste, forced_half=half,
                dropout_rate=rate, dropout_rng=drop_key if rate > 0.0 else None,
            )  # fmt: skip
            return out, num

        run = map_over_heads(head, sparse_heads_per_step())
        out, num = run(sample_keys, drop_keys, q, k, v, ys, zk, masks, deltas)
        return out, num / real_pairs, jax.lax.stop_gradient(num).astype(jnp.int32)

    pairs = batch * heads * n * m
    dense_allowed = pairs <= max_dense_elements
    ops = (q, k, v, ys, zk, oversample, counts)
    if impl == "auto" and dense_allowed and n * m <= dense_below:
        out, density, edges = dense_branch(ops)
        path = jnp.asarray(dense_index, jnp.int32)
    elif not dense_allowed:
        out, density, edges = fused_branch(ops)
        path = jnp.asarray(0, jnp.int32)
    else:
        use_dense = jnp.any(bound > BERNOULLI_MAX_BOUND) if law == "bernoulli" else False
        if impl == "auto":
            cost = calibrated_edge_cost("fused") if edge_cost is None else edge_cost
            forced = _forced_per_row(self_loops, window, length) * n * batch * heads
            draws = jnp.sum(counts).astype(f32) + forced
            cheaper = False if cost is None else draws * cost >= jnp.float32(pairs)
            use_dense = jnp.logical_or(use_dense, cheaper)
        branches = [
            jax.checkpoint(fused_branch, policy=SPARSE_BRANCH_POLICY),
            jax.checkpoint(dense_branch, policy=SPARSE_BRANCH_POLICY),
        ]
        index = jnp.asarray(use_dense, jnp.int32)
        out, density, edges = jax.lax.switch(index, branches, ops)
        path = jnp.where(index == 1, dense_index, 0).astype(jnp.int32)
    overflow = jnp.zeros((batch, heads), bool)
    stats = {"density": density, "edges": edges, "overflow": overflow, "path": path}
    return out, stats


#: Collection the SBM layer sows its memberships ``Y``, ``Z`` and block matrix ``S``
#: into, only when the caller asks: ``apply(..., mutable=[MAPS_COLLECTION])`` (they are
#: ``[B, H, n, k]`` each, so nothing is computed or kept otherwise).
MAPS_COLLECTION = "attention_maps"


def expected_token_densities(
    q_memberships: jax.Array, block: jax.Array, k_memberships: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per-token expected density of each head's graph: ``(query, key)``, ``[B, H, L]``.

    With ``p = Y S Z^T`` (the expected mask of the paper, eq. 8; padded rows of ``Y``
    and ``Z`` zeroed), ``query[b, h, i] = mean_j p_ij`` over the real keys ``j`` (the
    expected fraction of tokens query ``i`` attends to) and ``key[b, h, j] = mean_i p_ij``
    over the real queries ``i`` (the expected fraction of tokens that attend to key
    ``j``: the paper's figs. 7-8). Padded positions are 0. Neither the exploration
    ``delta`` nor forced edges (``self_loops``, ``window``) are included. Costs
    ``O(L k + k^2)`` per head: ``p`` is never formed.

    Shapes: memberships ``[B, H, L, k]``, ``block [H, k, k]``, ``mask [B, L]`` bool.
    """
    real = mask.astype(jnp.float32)
    y = q_memberships.astype(jnp.float32) * real[:, None, :, None]
    z = k_memberships.astype(jnp.float32) * real[:, None, :, None]
    count = jnp.maximum(jnp.sum(real, axis=-1), 1.0)[:, None, None]  # [B, 1, 1]
    hi = jax.lax.Precision.HIGHEST  # k-term sums: keep them float32 on every backend
    block = block.astype(jnp.float32)
    s_zsum = jnp.einsum("hkl,bhl->bhk", block, jnp.sum(z, axis=2), precision=hi)
    ysum_s = jnp.einsum("bhk,hkl->bhl", jnp.sum(y, axis=2), block, precision=hi)
    query = jnp.einsum("bhik,bhk->bhi", y, s_zsum, precision=hi) / count
    key = jnp.einsum("bhjl,bhl->bhj", z, ysum_s, precision=hi) / count
    return query, key


CLUSTER_INITS = ("paper", "reference")


def cluster_initializer(kind: str = "paper") -> nn.initializers.Initializer:
    """Kaiming-normal init of the ``[heads, k, head_dim]`` cluster embeddings.

    ``"paper"``: per head, fan-in ``head_dim`` (std ``sqrt(2 / d_h)``, 0.25 at 32).
    ``"reference"``: PyTorch's kaiming_normal_ on the whole tensor, fan-in ``k * d_h``
    (std ~0.022 at k=128, d_h=32), as the reference code does.
    """
    if kind == "paper":
        return nn.initializers.variance_scaling(
            2.0, "fan_in", "normal", in_axis=-1, out_axis=-2, batch_axis=(0,)
        )
    if kind == "reference":
        return nn.initializers.variance_scaling(
            2.0, "fan_in", "normal", in_axis=(-2, -1), out_axis=0
        )
    raise ValueError(f"cluster_init={kind!r} is not one of {CLUSTER_INITS}")


def sbm_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head, k clusters, E = ``density`` n^2 sampled edges (None: n^2):
    ``memberships_mlp 2 (2 * 2nd^2 + 3nd)`` (two-layer MLP with biases and relu on Q and
    K); ``memberships 2 (2nkd + nk)`` (x C^T, sigmoid); ``block_matrix 2k^2 d + 5k^2``
    (S = softmax(C C^T)); ``expected_edges 2nk^2 + 2nk + 2k^2`` (Y S, column sums,
    bilinear form); ``edge_sampling E (log2 k^2 + 2 log2 n + 2k + 2)`` (inverse-CDF picks
    of block and nodes, p_ij = (YS)_i . z_j, keep test); ``ste E``; then softmax
    attention over the E edges (``scale nd``, ``scores 2Ed``, ``softmax 5E``,
    ``aggregation 2Ed``)."""
    k = int(options["num_clusters"])
    rho = 1.0 if density is None else float(density)
    e = rho * n * n
    per_edge = math.log2(max(k * k, 2)) + 2.0 * math.log2(max(n, 2)) + 2.0 * k + 2.0
    return {
        **projection_flops(n, D, H, d),
        "memberships_mlp": H * 2 * (2 * 2.0 * n * d * d + 3.0 * n * d),
        "memberships": H * 2 * (2.0 * n * k * d + n * k),
        "block_matrix": H * (2.0 * k * k * d + SOFTMAX * k * k),
        "expected_edges": H * (2.0 * n * k * k + 2.0 * n * k + 2.0 * k * k),
        "edge_sampling": H * e * per_edge,
        "ste": H * e,
        **edge_flops([e] * H, n, d),
    }


def sbm_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections, clusters ``[H, k, d]`` and the membership MLP (two
    ``[d, d]`` layers with biases, per head unless ``shared_mlp``)."""
    mlp = 2 * (d * d + d) * (1 if options["shared_mlp"] else H)
    return projection_params(D, H, d) + H * int(options["num_clusters"]) * d + mlp


@register("sbm", flops=sbm_flops, params=sbm_params)
class SBMAttention(nn.Module):
    """Multi-head SBM attention on ``x [batch, length, dim]`` with a padding mask.

    Attributes:
      num_heads, head_dim, out_dim: head count, per-head width, output width.
      attention_dropout: dropout on the normalised edge weights (training only).
      dtype: compute dtype of the projections (memberships and sampling use float32).
      num_clusters: ``k``, clusters per head (paper: 128).
      delta: exploration probability added to every real pair, training only.
      edge_law: ``"bernoulli"`` (the paper's model) or ``"poisson"`` (raw fastRG).
      self_loops: add ``(i, i)`` for every real token (the "+I" variant).
      shared_mlp: one membership MLP for all heads (reference code) instead of one per
        head (paper).
      capacity_buckets: sorted fractions of ``n*m`` in (0, 1]; the sparse branches.
      impl: ``"auto"`` (buckets the cost model keeps, dense above them and for short
        sequences), ``"sparse"`` (every bucket, dense only above them), ``"dense"``
        (always the dense path, streamed over query blocks), ``"streamed"`` (blocks of
        query rows, see ``stream_rows``).
      window: if > 0, union a local window ``|i - j| <= window // 2`` with the graph.
      dense_below: with ``impl="auto"``, sequences with ``n*m`` at or below this always
        take the dense path (sparse bookkeeping costs more there).
      edge_cost: with ``impl="auto"``, the cost of one sparse slot relative to one pair
        of the dense path; buckets with ``(capacity + forced edges) * edge_cost >= n*m``
        are left out, so such batches run dense. ``None`` (default): the calibrated
        value of the backend and kernel (:func:`sbm_jax.kernels.cost.edge_cost`).
      max_dense_elements: the dense path is built only if ``batch*heads*n*m`` is at most
        this; otherwise draws above the largest bucket are lost, and the stat
        ``overflow`` (``[batch, heads]`` bool, sown every call) marks those graphs.
        Default: no limit (the dense path is streamed, so this bounds its compute, not
        its memory).
      max_edge_slots: a sparse bucket is built only if its slots over the batch,
        ``batch*heads*capacity`` (plus forced edges), are at most this; its memory is
        ~20-30 bytes per slot, and a ``lax.switch`` reserves its largest branch's. Draws
        above the buckets built take the dense path (streamed, O(n d) memory). Both
        budgets count the batch as the layer sees it under ``jit``, the global one: with
        the batch split over N devices each holds 1/N of it, so N times the budget
        fits the same memory per device.
      kernel: edge-attention implementation of the sparse path: ``"rows"`` (default,
        the fastest measured), ``"segment"`` (the reference), ``"triton"`` (a Pallas
        kernel for NVIDIA GPUs, refused on other backends) or ``"auto"`` (the cheapest
        measured on the backend, :func:`sbm_jax.kernels.cost.resolve_kernel`); see
        :func:`sbm_jax.edge_ops.edge_attention`.
      cluster_init: ``"paper"`` or ``"reference"`` (see :func:`cluster_initializer`).
      ste: the estimator of the sampled mask, on every path: ``"paper"`` (eq. 9, the
        mask scales the logit: ``dL/dp_e = dL/da_e * s_e``) or ``"reference"`` (the
        authors' released code: the mask multiplies the post-softmax weights, rows are
        renormalised, and ``dL/dp_e = clip(dL/dM_e, -1, 1)`` with the density term
        inside the clip), or ``"pairs"`` (ours, not in the paper): every real pair,
        sampled or not, gets the first-order change of the loss when it is removed or
        added (all pairs on the dense path, :mod:`sbm_jax.kernels.dense`; on the sparse
        path the absent ones are estimated from ``pair_probes`` keys per query row,
        :mod:`sbm_jax.kernels.pairs`). Same forward pass.
      pair_probes: probe keys per query row of ``ste="pairs"`` on the sparse path
        (unbiased; at least the sequence length: every key, exact, with ``n * m * k``
        backward temporaries, so for short sequences and tests only).
      stream_rows: with ``impl="streamed"`` (each graph walked in blocks of query rows,
        drawn into a small buffer per block and drawn again in the backward pass, so
        memory follows neither a bucket's capacity nor the draws;
        :mod:`sbm_jax.kernels.streamed`), the query rows per block; 0: automatic
        (``rows * length`` near 2^20).
      stream_slots: with ``impl="streamed"``, one buffer of this many slots per block
        instead of ``capacity_buckets``' fractions of the block's pairs (0); it must hold
        at least one draw per row of a block. A block whose draws exceed its largest
        buffer runs dense, alone.

    Stats sown into ``attention_stats`` every call: ``density [B, H]`` (differentiable
    through ``ste``), ``edges [B, H]``, ``overflow [B, H]`` bool (True where that graph's
    draws exceeded the largest bucket and edges were lost; sum it for a count),
    ``path []`` (the bucket index, ``len(capacity_buckets)`` for the dense path), and
    the per-token expected densities ``query_density [B, H, L]`` and ``key_density
    [B, H, L]`` (0 at padded positions; see :func:`expected_token_densities`), the same
    on every path.

    On request only, when ``apply`` is called with ``mutable=[MAPS_COLLECTION]``
    (``"attention_maps"``; never during ``init``): ``q_memberships`` and
    ``k_memberships [B, H, L, k]`` (``Y`` and ``Z`` of eqs. 6-7, 0 at padded positions)
    and ``block [H, k, k]`` (``S`` of eq. 5), so ``p = Y S Z^T``.
    """

    num_heads: int
    head_dim: int
    out_dim: int | None = None
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    num_clusters: int = 128
    delta: float = 0.01
    edge_law: str = "bernoulli"
    self_loops: bool = False
    shared_mlp: bool = False
    capacity_buckets: tuple[float, ...] = (1 / 64, 1 / 16, 1 / 4)
    impl: str = "auto"
    window: int = 0
    dense_below: int = 128 * 128
    edge_cost: float | None = None
    max_dense_elements: int = NO_DENSE_LIMIT
    max_edge_slots: int = 2**26
    kernel: str = "auto"
    cluster_init: str = "paper"
    ste: str = "paper"
    pair_probes: int = DEFAULT_PAIR_PROBES
    stream_rows: int = 0
    stream_slots: int = 0

    def paths_for(self, batch: int, length: int) -> tuple[tuple[int, ...], bool]:
        """:func:`plan_paths` under this module's options for a ``[batch, length]`` input
        (the choice its call makes; a ValueError naming the fields when no path fits):
        what a config check runs for each batch a training run will trace. With
        ``impl="streamed"``: :func:`plan_stream`'s per-block buffers and whether blocks
        may run dense."""
        kernel = resolve_kernel(self.kernel)
        if kernel == "fused" and self.impl in ("auto", "sparse"):
            # No capacity buckets: every batch runs the fused kernel or the dense path.
            dense = batch * self.num_heads * length * length <= self.max_dense_elements
            return (), dense
        if self.impl == "streamed":
            _, caps, dense = plan_stream(
                batch=batch,
                heads=self.num_heads,
                length=length,
                capacity_buckets=tuple(float(c) for c in self.capacity_buckets),
                stream_rows=self.stream_rows,
                stream_slots=self.stream_slots,
                kernel="rows" if kernel in ("segment", "fused") else kernel,
                edge_cost=self.edge_cost,
                max_dense_elements=self.max_dense_elements,
                max_edge_slots=self.max_edge_slots,
                forced_per_row=_forced_per_row(self.self_loops, self.window, length),
            )
            return caps, dense
        return plan_paths(
            batch=batch,
            heads=self.num_heads,
            length=length,
            capacity_buckets=tuple(float(c) for c in self.capacity_buckets),
            impl=self.impl,
            kernel=kernel,
            dense_below=self.dense_below,
            edge_cost=self.edge_cost,
            max_dense_elements=self.max_dense_elements,
            max_edge_slots=self.max_edge_slots,
            forced_per_row=_forced_per_row(self.self_loops, self.window, length),
        )

    def validate(self) -> None:
        """Raise ValueError naming the bad field; runs before anything is traced."""
        check_fields(self)  # num_heads, head_dim, out_dim, attention_dropout
        for field in ("num_clusters", "pair_probes"):
            check_int(field, getattr(self, field))
        if not isinstance(self.delta, numbers.Real) or not 0.0 <= self.delta <= 1.0:
            raise ValueError(f"delta must lie in [0, 1] (a probability), got {self.delta!r}")
        check_law(self.edge_law, "edge_law")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not one of {IMPLS}")
        if isinstance(self.capacity_buckets, str):
            raise ValueError(
                f"capacity_buckets must be a tuple of numbers, got {self.capacity_buckets!r}"
            )
        buckets = tuple(self.capacity_buckets)
        bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, numbers.Real)]
        if bad:
            raise ValueError(f"capacity_buckets must be numbers (fractions of n*m), got {bad}")
        if not buckets:
            raise ValueError("capacity_buckets must name at least one fraction of n*m")
        if any(not 0.0 < f <= 1.0 for f in buckets):
            raise ValueError(f"capacity_buckets must lie in (0, 1], got {buckets}")
        if any(b <= a for a, b in zip(buckets, buckets[1:], strict=False)):
            raise ValueError(f"capacity_buckets must be strictly increasing, got {buckets}")
        if self.cluster_init not in CLUSTER_INITS:
            raise ValueError(f"cluster_init={self.cluster_init!r} is not one of {CLUSTER_INITS}")
        if self.edge_cost is not None and not self.edge_cost > 0:
            raise ValueError(f"edge_cost must be > 0 (or None), got {self.edge_cost}")
        if self.kernel not in EDGE_KERNELS:
            raise ValueError(f"kernel={self.kernel!r} is not one of {EDGE_KERNELS}")
        resolve_kernel(self.kernel)  # a GPU-only kernel on another backend: one line
        check_ste(self.ste, "ste")
        for field in (
            "window",
            "max_dense_elements",
            "max_edge_slots",
            "dense_below",
            "stream_rows",
            "stream_slots",
        ):
            check_int(field, getattr(self, field), minimum=0)
        if 0 < self.stream_slots < self.stream_rows:
            raise ValueError(
                f"stream_slots={self.stream_slots} is too small for a block of "
                f"stream_rows={self.stream_rows} query rows: it must hold at least one draw "
                "per row, or every block would run dense"
            )

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        self.validate()
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        batch, length, dim = x.shape
        mask = mask.astype(bool)
        heads, hd, k = self.num_heads, self.head_dim, self.num_clusters
        out_dim = self.out_dim or dim

        q = head_dense(heads, hd, self.dtype, "query")(x)  # [B, L, H, hd]
        kk = head_dense(heads, hd, self.dtype, "key")(x)
        v = head_dense(heads, hd, self.dtype, "value")(x)

        # Logical axis names: per head (or one shared MLP: no head axis), the MLP's
        # input and hidden widths (kv, mlp) and the clusters.
        clusters = self.param(
            "clusters",
            named(cluster_initializer(self.cluster_init), HEADS, "clusters", KV),
            (heads, k, hd),
        )
        lead = () if self.shared_mlp else (HEADS,)
        mlp_shape = (hd, hd) if self.shared_mlp else (heads, hd, hd)
        bias_shape = (hd,) if self.shared_mlp else (heads, hd)
        init = nn.initializers.lecun_normal()
        zeros = nn.initializers.zeros
        w1 = self.param("mlp_w1", named(init, *lead, KV, "mlp"), mlp_shape)
        b1 = self.param("mlp_b1", named(zeros, *lead, "mlp"), bias_shape)
        w2 = self.param("mlp_w2", named(init, *lead, "mlp", KV), mlp_shape)
        b2 = self.param("mlp_b2", named(zeros, *lead, KV), bias_shape)

        with jax.named_scope(MEMBERSHIPS):
            # Heads-major from here on ([B, H, L, hd]): the core takes that layout, and the
            # memberships ([B, H, L, k], 4x wider at k=128, hd=32) then come out of their
            # einsum in it, with no transpose of theirs in either pass.
            q, kk, v = (t.transpose(0, 2, 1, 3) for t in (q, kk, v))

            def node_embed(t: jax.Array) -> jax.Array:  # [B, H, L, hd] -> [B, H, L, hd]
                t = t.astype(jnp.float32)
                if self.shared_mlp:
                    h = jax.nn.relu(jnp.einsum("bhld,de->bhle", t, w1) + b1)
                    return jnp.einsum("bhld,de->bhle", h, w2) + b2
                w1b, w2b = (jnp.broadcast_to(w, (batch, *w.shape)) for w in (w1, w2))
                h = jax.nn.relu(jnp.einsum("bhld,bhde->bhle", t, w1b) + b1[:, None, :])
                return jnp.einsum("bhld,bhde->bhle", h, w2b) + b2[:, None, :]

            # The clusters broadcast over the batch: (b, h) are then the product's batch
            # dimensions on both sides, and XLA transposes nothing [B, H, L, k]-sized.
            per_example = jnp.broadcast_to(clusters, (batch, *clusters.shape))
            q_memb = jax.nn.sigmoid(jnp.einsum("bhld,bhkd->bhlk", node_embed(q), per_example))
            k_memb = jax.nn.sigmoid(jnp.einsum("bhld,bhkd->bhlk", node_embed(kk), per_example))
            logits = jnp.einsum("hkd,hjd->hkj", clusters, clusters).reshape(heads, k * k)
            block = jax.nn.softmax(logits, axis=-1).reshape(heads, k, k)

        if not self.has_rng("sample"):
            raise ValueError(
                "SBMAttention samples its graph from the 'sample' rng stream: pass "
                "rngs={'sample': key} to apply (it stays on at evaluation)"
            )
        rate = 0.0 if deterministic else self.attention_dropout
        out, stats = sbm_attention_core(
            self.make_rng("sample"),
            q,
            kk,
            v,
            q_memb,
            block,
            k_memb,
            mask,
            delta=0.0 if deterministic else self.delta,
            law=self.edge_law,
            capacity_buckets=tuple(self.capacity_buckets),
            impl=self.impl,
            self_loops=self.self_loops,
            window=self.window,
            dense_below=self.dense_below,
            edge_cost=self.edge_cost,
            max_dense_elements=self.max_dense_elements,
            max_edge_slots=self.max_edge_slots,
            dropout_rate=rate,
            dropout_rng=self.make_rng("dropout") if rate > 0.0 else None,
            kernel=self.kernel,
            ste=self.ste,
            pair_probes=self.pair_probes,
            stream_rows=self.stream_rows,
            stream_slots=self.stream_slots,
        )
        for name in ("density", "edges", "overflow", "path"):
            self.sow(STATS_COLLECTION, name, stats[name])
        query_density, key_density = expected_token_densities(q_memb, block, k_memb, mask)
        self.sow(STATS_COLLECTION, "query_density", query_density)
        self.sow(STATS_COLLECTION, "key_density", key_density)
        if self.is_mutable_collection(MAPS_COLLECTION) and not self.is_initializing():
            real = mask[:, None, :, None]
            self.sow(MAPS_COLLECTION, "q_memberships", jnp.where(real, q_memb, 0.0))
            self.sow(MAPS_COLLECTION, "k_memberships", jnp.where(real, k_memb, 0.0))
            self.sow(MAPS_COLLECTION, "block", block)
        out = out.transpose(0, 2, 1, 3).astype(self.dtype)  # [B, L, H, hd]
        return out_dense(out_dim, self.dtype)(out)
