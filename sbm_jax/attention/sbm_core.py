"""The SBM core: sample one graph per (example, head) and attend over it (a pure function
of the projections, the memberships and the block matrix; :class:`SBMAttention` computes
those and calls :func:`sbm_attention_core`).

Three paths, chosen statically from the :class:`~sbm_jax.attention.sbm_paths.SBMOptions`
(:mod:`sbm_jax.attention.sbm_paths`):

* bucketed (``impl`` ``"auto"``, ``"sparse"``, ``"dense"``): the Poisson draw counts are
  drawn first; the smallest capacity bucket that holds the largest count runs under
  ``lax.switch``; above the largest bucket (or where the bernoulli law's bound is too
  close to 1) the dense path runs, which samples the same law pair by pair, streamed
  over blocks of query rows (:mod:`sbm_jax.kernels.dense`);
* streamed (``impl="streamed"``): each graph walked in blocks of query rows, drawn
  again in the backward pass (:mod:`sbm_jax.kernels.streamed`);
* fused (``kernel="fused"``, CPU): fastRG and edge attention in one native call per
  pass (:mod:`sbm_jax.kernels.fused`), or the dense path.

No edge is ever dropped unless the dense path was ruled out by ``max_dense_elements``;
then the per-call ``overflow`` stat counts the graphs whose draws exceeded the largest
bucket.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sbm_jax._scopes import SAMPLE
from sbm_jax._varying import vary_like
from sbm_jax.attention.sbm_paths import (
    SBMOptions,
    choose_bucket,
    forced_half_width,
    plan_fused,
    plan_paths,
    plan_stream,
)
from sbm_jax.edge_ops import EDGE_KERNEL_RESIDUAL_NAMES, edge_attention
from sbm_jax.fastrg import (
    PREFIX_STEPS,
    THIN_BUDGET,
    SamplingPlan,
    edges_from_keys,
    make_plan,
    needs_dense,
    row_max_bound,
    sample_edge_keys,
)
from sbm_jax.kernels.cost import edge_cost as calibrated_edge_cost
from sbm_jax.kernels.dense import streamed_sbm_attention, streamed_sbm_attention_graphs
from sbm_jax.kernels.fused import EDGE_CACHE_NAME
from sbm_jax.kernels.pairs import expected_pair_sum, with_absent_pairs
from sbm_jax.kernels.streamed import StreamConfig, streamed_graphs
from sbm_jax.ste import clip_cotangent, edge_logit_terms, edge_probs_straight_through


def forced_edge_keys(
    q_mask: jax.Array, k_mask: jax.Array, *, self_loops: bool, window: int
) -> jax.Array | None:
    """Keys ``row * m + col`` of the always-present edges (``n * m`` for none).

    ``window > 0`` adds every real pair with ``|i - j| <= window // 2`` (self included);
    ``self_loops`` adds ``(i, i)`` for real tokens.
    """
    n, m = q_mask.shape[0], k_mask.shape[0]
    half = forced_half_width(self_loops, window, max(n, m))
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
    half = forced_half_width(self_loops, window, max(n, m))
    if half is None:
        return None
    dist = jnp.abs(jnp.arange(n)[:, None] - jnp.arange(m)[None, :])
    return (dist <= half) & q_mask[:, None] & k_mask[None, :]


def _real_pairs(q_mask: jax.Array, k_mask: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.sum(q_mask) * jnp.sum(k_mask), 1).astype(jnp.float32)


#: checkpoint_name of the fused path's sampling plan (the rows' oversampling and draws).
FUSED_PLAN_NAME = "sbm_fused_plan"

#: Names of the values a sparse branch keeps for its backward pass (see
#: :data:`SPARSE_BRANCH_POLICY`): the sampled edge keys and the edge kernel's output and
#: softmax statistics. Everything else (edge list, kernel layout, STE) is recomputed
#: from them in O(C); fastRG and the attention forward run once per training step. The
#: dense branch is checkpointed with the same policy: its streamed kernel tags its output
#: and log-normaliser with the same names, and it has no edge keys. The fused path also
#: keeps its sampling plan (:data:`FUSED_PLAN_NAME`) and its kernel's edge cache
#: (``edge_cache``; one-element placeholders without it).
SAVED_NAMES = ("sbm_edge_keys", *EDGE_KERNEL_RESIDUAL_NAMES, EDGE_CACHE_NAME, FUSED_PLAN_NAME)
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
    options: SBMOptions,
    capacity,
    thin_budget=None,
    prefix_steps=1,
):
    o = options
    n, m = plan.y.shape[0], plan.z.shape[0]
    forced = forced_edge_keys(plan.q_mask, plan.k_mask, self_loops=o.self_loops, window=o.window)
    keys = sample_edge_keys(
        key,
        plan,
        count,
        capacity=capacity,
        law=o.law,
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
    if o.ste == "reference":
        m_ste = clip_cotangent(m_ste)
    out = edge_attention(
        q,
        k,
        v,
        edges,
        **edge_logit_terms(m_ste, o.ste),
        dropout_rate=o.dropout_rate,
        dropout_rng=drop_key,
        impl=o.kernel,
        return_lse=o.ste == "pairs",
    )
    if o.ste == "pairs":
        # Absent pairs, estimated from probe keys per row (sbm_jax.kernels.pairs), and the
        # count's cotangent on every real pair (the gradient of the expected count).
        out, lse = out
        out, num = with_absent_pairs(
            jax.random.fold_in(key, 1), q, k, v, out, lse, plan.ys, plan.z, keys,
            plan.q_mask, plan.k_mask, probes=o.pair_probes,
        )  # fmt: skip
        density = num / real
    else:
        density = jnp.sum(jnp.where(edges.valid, m_ste, 0.0)) / real
    return out, density, edges.num_edges, jnp.sum(count) > capacity


def _dense_graph(key, drop_key, q, k, v, ys, zk, q_mask, k_mask, delta, *, options: SBMOptions):
    """One graph on the dense path: ``(out, edge count)``. Streamed over blocks of query
    rows: p, mask, scores and weights exist one block at a time, forward and backward
    (:mod:`sbm_jax.kernels.dense`)."""
    rate = options.dropout_rate
    return streamed_sbm_attention(
        key,
        q,
        k,
        v,
        ys,
        zk,
        q_mask,
        k_mask,
        delta,
        law=options.law,
        ste=options.ste,
        forced_half=options.forced_half(q.shape[-2]),
        dropout_rate=rate,
        dropout_rng=drop_key if rate > 0.0 else None,
    )


def _dense_head(key, drop_key, plan: SamplingPlan, count, q, k, v, *, options: SBMOptions):
    del count
    kc = plan.ys.shape[1]
    out, num = _dense_graph(
        key, drop_key, q, k, v, plan.ys, plan.z[:, :kc], plan.q_mask, plan.k_mask,
        plan.delta, options=options,
    )  # fmt: skip
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
    temporaries by ``B*H`` and pushes them out of cache, which made the kernel and fastRG
    slower there.
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
    dropout_rng: jax.Array | None = None,
    options: SBMOptions | None = None,
    **fields: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sample one graph per (example, head) and attend over it. Pure function.

    Shapes: ``q, k, v [B, H, L, d]``, ``q_memberships, k_memberships [B, H, L, k]``,
    ``block [H, k, k]``, ``mask [B, L]`` bool. Returns ``out [B, H, L, d]`` and stats:
    ``density [B, H]`` (differentiable through the estimator ``ste``), ``edges [B, H]``,
    ``overflow [B, H]`` bool (that graph's draws exceeded the largest bucket, so edges
    were lost: only possible when ``max_dense_elements`` rules out the dense path),
    ``path []`` (bucket index into ``capacity_buckets``; ``len(capacity_buckets)`` = the
    dense path). See :func:`~sbm_jax.attention.sbm_paths.plan_paths` for the static path
    choice; ``impl="streamed"`` walks each graph in blocks of query rows instead
    (:func:`~sbm_jax.attention.sbm_paths.plan_stream`, :mod:`sbm_jax.kernels.streamed`;
    ``stream_rows``, ``stream_slots``), and ``path`` is then the largest per-block buffer
    index any block used.

    ``options``: the :class:`~sbm_jax.attention.sbm_paths.SBMOptions` to run
    (``SBMAttention.core_options``); without it, its fields by keyword (``law``,
    ``capacity_buckets``, ``impl``, ...; the others at their defaults). ``delta``: the
    exploration probability (traced); ``dropout_rng``: the key of the edge-weight
    dropout, which runs only with one (at ``options.dropout_rate``).

    The body runs under one ``jax.jit`` whose static argument is the options object:
    called eagerly, as ``model.init`` and ``model.apply`` are in a notebook, it then
    compiles as one program instead of several hundred single operations. Under an
    outer ``jit`` it is inlined like any other function.
    """
    if options is None:
        options = SBMOptions(**fields)
    elif fields:
        raise TypeError(
            f"sbm_attention_core takes options or their fields by keyword, not both: got "
            f"options and {sorted(fields)}"
        )
    options = options.resolved()  # the law and ste checked, "auto" kernel resolved
    if dropout_rng is None:
        options = dataclasses.replace(options, dropout_rate=0.0)
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
        options=options,
    )


@partial(jax.jit, static_argnames=("options",))
def _sbm_attention_core(
    rng, q, k, v, q_memberships, block, k_memberships, mask, *, delta, dropout_rng, options
) -> tuple[jax.Array, dict[str, jax.Array]]:
    if options.fused:
        core = _fused_core
    elif options.impl == "streamed":
        core = _streamed_core
    else:
        core = _bucketed_core
    return core(
        rng, q, k, v, q_memberships, block, k_memberships, mask,
        delta=delta, dropout_rng=dropout_rng, options=options,
    )  # fmt: skip


def _plans(q_memberships, block, k_memberships, mask, delta, law) -> SamplingPlan:
    """One :class:`~sbm_jax.fastrg.SamplingPlan` per (example, head), ``[B, H]``. No
    search tables: each graph builds its own where it is sampled (``with_tables``), so
    that on CPU, where the graphs run one at a time, they exist for one graph at a time,
    not for all ``B*H`` of them across the sampling."""

    def plan_one(qm, blk, km, qmask, kmask):
        return make_plan(
            qm, blk, km, delta=delta, q_mask=qmask, k_mask=kmask, law=law, tables=False
        )

    # The block matrix broadcast over the batch, as in the layer: Y S is then a product
    # batched over (b, h) on both sides, with no transpose of Y around it.
    per_example = jnp.broadcast_to(block, (mask.shape[0], *block.shape))
    return jax.vmap(jax.vmap(plan_one, in_axes=(0, 0, 0, None, None)))(
        q_memberships, per_example, k_memberships, mask, mask
    )


def _graph_keys(rng, dropout_rng, rate, batch, heads):
    """``(count key, sample keys [B, H], dropout keys [B, H])``, split the same way on
    every path (the dropout keys are the sample keys, unused, without dropout)."""
    k_count, k_sample = jax.random.split(rng)
    sample_keys = jax.random.split(k_sample, (batch, heads))
    drop_keys = jax.random.split(dropout_rng, (batch, heads)) if rate > 0.0 else sample_keys
    return k_count, sample_keys, drop_keys


def _bucketed_core(
    rng, q, k, v, q_memberships, block, k_memberships, mask, *, delta, dropout_rng, options
):
    """``impl`` ``"auto"``, ``"sparse"`` or ``"dense"``: one ``lax.switch`` over the
    capacity buckets :func:`~sbm_jax.attention.sbm_paths.plan_paths` keeps and the dense
    branch, the index one scalar for the batch."""
    o = options
    batch, heads, length, _ = q.shape
    dense_index = len(o.capacity_buckets)  # the recorded path of the dense branch
    caps, dense_allowed = plan_paths(o, batch=batch, heads=heads, length=length)
    plans = _plans(q_memberships, block, k_memberships, mask, delta, o.law)
    k_count, sample_keys, drop_keys = _graph_keys(rng, dropout_rng, o.dropout_rate, batch, heads)
    per_step = sparse_heads_per_step()
    dense_fn = map_over_heads(partial(_dense_head, options=o), per_step)

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
        # then carries only the named values.
        def branch(c):
            head = partial(_sparse_head, options=o, capacity=c, **sampling)
            per_head = jax.checkpoint(head, policy=SPARSE_BRANCH_POLICY)
            return jax.checkpoint(map_over_heads(per_head, per_step), policy=SPARSE_BRANCH_POLICY)

        branches = [branch(c) for c in caps]
        force_dense = jnp.any(needs_dense(plans, o.law))
        path = choose_bucket(counts, caps, force_dense)  # caps are a prefix of the buckets
        if dense_allowed:
            # Checkpointed too, keeping only the streamed kernel's output and
            # log-normaliser (tagged like the edge kernels'), so that the backward pass
            # does not run its forward again. Without it the switch carried the dense
            # path's own stacked residuals ([B*H, n, k] Y S and Z among them), and every
            # sparse branch had to fill them with zeros: lax.switch gives each branch
            # the union of all branches' residuals. Same outputs and gradients bit for
            # bit, in less memory.
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
    rng, q, k, v, q_memberships, block, k_memberships, mask, *, delta, dropout_rng, options
):
    """``impl="streamed"``: every graph walked in blocks of query rows, each block drawn
    into a small buffer and drawn again in the backward pass (:mod:`sbm_jax.kernels.streamed`).
    Same plans, row counts and keys as the bucketed path up to the per-block folding."""
    o = options
    batch, heads, length, _ = q.shape
    bq, caps, dense_allowed = plan_stream(o, batch=batch, heads=heads, length=length)
    plans = _plans(q_memberships, block, k_memberships, mask, delta, o.law)
    k_count, sample_keys, drop_keys = _graph_keys(rng, dropout_rng, o.dropout_rate, batch, heads)
    with jax.named_scope(SAMPLE):
        row_counts = jax.random.poisson(k_count, plans.row_rate).astype(jnp.int32)
    force_dense = jax.vmap(jax.vmap(lambda p: needs_dense(p, o.law)))(plans)
    half = o.forced_half(length)
    cfg = StreamConfig(
        block_rows=bq,
        capacities=caps,
        dense=dense_allowed,
        law=o.law,
        ste=o.ste,
        forced_half=-1 if half is None else half,
        dropout_rate=o.dropout_rate,
        pair_probes=o.pair_probes,
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
    dense_index = len(o.capacity_buckets)
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

    ``ys [B, H, n, k]`` (``Y S``), ``zk [B, H, m, k]`` (the key memberships; padded keys
    are left out here), ``mask [B, L]``. Row ``i`` draws ``Poisson(c_i sum_j (p_ij + delta))`` times
    (:func:`sbm_jax.fastrg.make_plan`'s ``row_rate``), with the bernoulli law's per-row
    oversampling ``c_i`` from the row bound ``q_i`` (:func:`~sbm_jax.fastrg.row_max_bound`
    plus ``delta``; 1 under the poisson law). Everything is under ``stop_gradient``."""
    f32 = jnp.float32
    sg = jax.lax.stop_gradient
    real = mask.astype(f32)[:, None, :]  # [B, 1, L]
    ys, zk = sg(ys), jnp.where(real[..., None] > 0, sg(zk), 0.0)  # padded keys weigh 0
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
    rng, q, k, v, q_memberships, block, k_memberships, mask, *, delta, dropout_rng, options
):
    """``kernel="fused"``: every graph sampled and attended in one native call per pass
    (:mod:`sbm_jax.kernels.fused`), or, with ``impl="auto"``, per batch the dense path
    where the cost model says the batch's draws cost more than it (:func:`plan_fused`).
    The kernel draws a row pair by pair itself where that is cheaper than its draws or
    where the bernoulli oversampling would explode (a row bound above 0.995), with the
    same law. No capacity: no draw is ever lost."""
    from sbm_jax.kernels.fused import (
        FusedConfig,
        default_threads,
        fused_or_dense_attention,
        fused_sbm_attention,
    )

    o = options
    batch, heads, length, _ = q.shape
    dense_index = len(o.capacity_buckets)  # the recorded path of the dense branch
    f32 = jnp.float32
    # Unmasked: neither path reads a padded row of Y S or a padded key's memberships (nor
    # sends them gradient), and the plan masks what it sums. The block matrix is broadcast
    # over the batch so that Y S is a product batched over (b, h) on both sides, with no
    # transpose of Y around it.
    zk = k_memberships.astype(f32)
    per_example = jnp.broadcast_to(block.astype(f32), (batch, *block.shape))
    ys = jnp.einsum("bhik,bhkl->bhil", q_memberships.astype(f32), per_example)
    delta = jnp.asarray(delta, f32)
    rate = o.dropout_rate
    k_count, sample_keys, drop_keys = _graph_keys(rng, dropout_rng, rate, batch, heads)
    with jax.named_scope(SAMPLE):
        oversample, counts, _ = fused_draws(k_count, ys, zk, mask, delta, o.law)
    # Kept for the backward pass ([B, H, n] each), which would otherwise draw the plan
    # again from Y S and Z (several passes over [B, H, n, k] arrays and the Poisson draws).
    oversample, counts = (checkpoint_name(a, FUSED_PLAN_NAME) for a in (oversample, counts))
    bits = jax.vmap(jax.vmap(lambda kk: jax.random.bits(kk, (2,), jnp.uint32)))
    seeds = bits(sample_keys)
    drop_seeds = bits(drop_keys) if rate > 0.0 else seeds
    half = o.forced_half(length)
    masks = jnp.broadcast_to(mask[:, None, :], (batch, heads, length))
    deltas = jnp.broadcast_to(delta, (batch, heads))
    real_pairs = jnp.maximum(jnp.sum(mask, -1) ** 2, 1).astype(f32)[:, None]  # [B, 1]

    def fused_config():
        return FusedConfig(
            law=o.law,
            forced_half=-1 if half is None else half,
            dropout_rate=rate,
            ste=o.ste,
            probes=o.pair_probes,
            threads=default_threads(),
            cache_slots=o.edge_cache * length,
        )

    def pairs_count_term(ys, zk):
        """0, whose cotangent is that of the count on every real pair (``"pairs"``: the
        kernel's count carries none; the closed form ``sum p`` carries it here)."""
        pair_sum = jax.vmap(jax.vmap(expected_pair_sum))(ys, zk, masks, masks)
        return pair_sum - jax.lax.stop_gradient(pair_sum)

    def fused_branch(ops):
        q, k, v, ys, zk, oversample, counts = ops
        out, num, edges = fused_sbm_attention(
            fused_config(), seeds, drop_seeds, q, k, v, ys, zk, oversample, counts, masks,
            masks, deltas,
        )  # fmt: skip
        if o.ste == "pairs":
            num = num + pairs_count_term(ys, zk)
        return out, num / real_pairs, edges

    def dense_branch(ops):
        q, k, v, ys, zk, _, _ = ops  # the dense path masks padded rows and keys itself

        def graphs(a):  # [B, H, ...] -> [B*H, ...] (raw or typed keys alike)
            return a.reshape(batch * heads, *a.shape[2:])

        # The graphs one after another under one custom VJP (this path runs on CPU):
        # its backward pass holds no per-graph copy of Y S, Z or their gradients.
        out, num = streamed_sbm_attention_graphs(
            graphs(sample_keys), *map(graphs, (q, k, v, ys, zk, masks, masks)),
            graphs(deltas), law=o.law, ste=o.ste, forced_half=half, dropout_rate=rate,
            dropout_rngs=graphs(drop_keys) if rate > 0.0 else None,
        )  # fmt: skip
        num = num.reshape(batch, heads)
        out = out.reshape(batch, heads, *out.shape[1:])
        return out, num / real_pairs, jax.lax.stop_gradient(num).astype(jnp.int32)

    run_fused, run_dense = plan_fused(o, batch=batch, heads=heads, length=length)
    ops = (q, k, v, ys, zk, oversample, counts)
    if not run_fused:
        out, density, edges = dense_branch(ops)
        path = jnp.asarray(dense_index, jnp.int32)
    elif not run_dense:
        out, density, edges = fused_branch(ops)
        path = jnp.asarray(0, jnp.int32)
    else:
        # The batch's draws (and forced pairs) against its pairs, in the cost model's unit.
        cost = calibrated_edge_cost("fused") if o.edge_cost is None else o.edge_cost
        pairs = batch * heads * length * length
        draws = jnp.sum(counts).astype(f32) + o.forced_per_row(length) * length * batch * heads
        use_dense = jnp.asarray(False if cost is None else draws * cost >= jnp.float32(pairs))
        # One custom VJP over both paths (fused_or_dense_attention): a lax.switch over
        # the two differentiable branches returned copies of q, k, v, Y S and Z from the
        # rematerialised forward pass as residuals (~14 MiB of temp at n=4096, B=2).
        out, num, edges = fused_or_dense_attention(
            fused_config(), use_dense, seeds, drop_seeds, sample_keys,
            drop_keys if rate > 0.0 else None, q, k, v, ys, zk, oversample, counts, masks,
            masks, deltas,
        )  # fmt: skip
        if o.ste == "pairs":  # the kernel's count term; the dense path's count has its own
            num = num + jnp.where(use_dense, 0.0, pairs_count_term(ys, zk))
        density = num / real_pairs
        path = jnp.where(use_dense, dense_index, 0).astype(jnp.int32)
    overflow = jnp.zeros((batch, heads), bool)
    stats = {"density": density, "edges": edges, "overflow": overflow, "path": path}
    return out, stats
