"""SBM attention (paper section 4): every head samples its own sparse graph.

Per head: ``S = softmax(C C^T)`` over all ``k*k`` entries (eq. 5), memberships
``Qhat = sigmoid(MLP(Q) C^T)`` and ``Khat = sigmoid(MLP(K) C^T)`` (eqs. 6-7), a graph
``M ~ SBM(Qhat, S, Khat)`` drawn by fastRG (eq. 8), and softmax attention over the
sampled edges whose scores carry the straight-through estimator of ``p`` (eq. 9).

This module is the Linen layer (:class:`SBMAttention`: parameters, projections,
memberships, the stats it sows) and its registry formulas. The sampling and attention
are the pure core, :func:`~sbm_jax.attention.sbm_core.sbm_attention_core`
(:mod:`sbm_jax.attention.sbm_core`), which runs under the layer's
:class:`~sbm_jax.attention.sbm_paths.SBMOptions` (:meth:`SBMAttention.core_options`)
and chooses its paths statically from them (:mod:`sbm_jax.attention.sbm_paths`). Their
names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax._remat import recompute_after_cotangent
from sbm_jax._scopes import MEMBERSHIPS
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
from sbm_jax.attention.sbm_core import (
    SAVED_NAMES,
    SPARSE_BRANCH_POLICY,
    forced_edge_keys,
    forced_edge_mask,
    fused_draws,
    map_over_heads,
    sampler_options,
    sbm_attention_core,
    sparse_heads_per_step,
)
from sbm_jax.attention.sbm_paths import (
    EDGE_KERNELS,
    IMPLS,
    NO_DENSE_LIMIT,
    SBMOptions,
    bucket_capacities,
    choose_bucket,
    choose_paths,
    plan_fused,
    plan_paths,
    plan_stream,
)
from sbm_jax.kernels.pairs import DEFAULT_PAIR_PROBES

__all__ = [
    "CLUSTER_INITS",
    "EDGE_KERNELS",
    "IMPLS",
    "MAPS_COLLECTION",
    "NO_DENSE_LIMIT",
    "SAVED_NAMES",
    "SPARSE_BRANCH_POLICY",
    "SBMAttention",
    "SBMOptions",
    "bucket_capacities",
    "choose_bucket",
    "choose_paths",
    "cluster_initializer",
    "expected_token_densities",
    "forced_edge_keys",
    "forced_edge_mask",
    "fused_draws",
    "map_over_heads",
    "plan_fused",
    "plan_paths",
    "plan_stream",
    "sampler_options",
    "sbm_attention_core",
    "sbm_flops",
    "sbm_params",
    "sparse_heads_per_step",
]


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


def memberships(
    q: jax.Array,
    kk: jax.Array,
    w1: jax.Array,
    b1: jax.Array,
    w2: jax.Array,
    b2: jax.Array,
    clusters: jax.Array,
    *,
    shared_mlp: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer's ``(Qhat, Khat, S)`` (eqs. 5-7) from its heads-major queries and keys
    ``[B, H, L, hd]``: ``sigmoid(MLP(.) C^T)`` with the membership MLP (per head, or one
    for all heads with ``shared_mlp``) and ``S = softmax(C C^T)`` over all ``k*k``
    entries. The per-head weights are broadcast over the batch, so that ``(b, h)`` are the
    products' batch dimensions on both sides and XLA transposes nothing ``[B, H, L, k]``
    sized."""
    batch = q.shape[0]
    heads, k = clusters.shape[:2]

    def node_embed(t: jax.Array) -> jax.Array:  # [B, H, L, hd] -> [B, H, L, hd]
        t = t.astype(jnp.float32)
        if shared_mlp:
            h = jax.nn.relu(jnp.einsum("bhld,de->bhle", t, w1) + b1)
            return jnp.einsum("bhld,de->bhle", h, w2) + b2
        w1b, w2b = (jnp.broadcast_to(w, (batch, *w.shape)) for w in (w1, w2))
        h = jax.nn.relu(jnp.einsum("bhld,bhde->bhle", t, w1b) + b1[:, None, :])
        return jnp.einsum("bhld,bhde->bhle", h, w2b) + b2[:, None, :]

    per_example = jnp.broadcast_to(clusters, (batch, *clusters.shape))
    q_memb = jax.nn.sigmoid(jnp.einsum("bhld,bhkd->bhlk", node_embed(q), per_example))
    k_memb = jax.nn.sigmoid(jnp.einsum("bhld,bhkd->bhlk", node_embed(kk), per_example))
    logits = jnp.einsum("hkd,hjd->hkj", clusters, clusters).reshape(heads, k * k)
    return q_memb, k_memb, jax.nn.softmax(logits, axis=-1).reshape(heads, k, k)


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
      kernel: implementation of the sparse path: ``"auto"`` (default: the cheapest
        measured on the backend, :func:`sbm_jax.kernels.cost.resolve_kernel`; ``"fused"``
        on CPU where it builds, ``"rows"`` elsewhere), ``"fused"`` (the native CPU
        kernel, :mod:`sbm_jax.kernels.fused`: fastRG and attention in one call per pass,
        no capacity buckets; refused on other backends), ``"rows"`` (fastRG in XLA into
        capacity buckets, then the row-wise edge kernel), ``"segment"`` (the reference)
        or ``"triton"`` (a Pallas kernel for NVIDIA GPUs, refused on other backends);
        see :func:`sbm_jax.edge_ops.edge_attention`.
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
      edge_cache: with the fused CPU kernel, edge slots per query row (4 bytes each,
        ``[B, H, length * edge_cache]`` int32 kept between the passes, beside each row's
        start and count) in which the forward pass keeps its edges, so that the backward
        pass draws again only the row blocks that did not fit (a block's room is its rows'
        draws plus forced pairs); 0 (default) keeps nothing edge-sized between the passes.
        Other kernels ignore it. It trades memory for time (the ``sbm (edge_cache=256)``
        rows of docs/benchmarks.md).

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
    edge_cache: int = 0

    def core_options(self, deterministic: bool = True) -> SBMOptions:
        """The :class:`SBMOptions` this module runs its core with: its fields of the same
        names, ``edge_law`` as ``law``, and ``attention_dropout`` as ``dropout_rate``
        unless ``deterministic`` (then 0). The values as set; the core takes
        :meth:`SBMOptions.resolved` of them."""
        same = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SBMOptions)
            if f.name not in ("law", "dropout_rate")
        }
        rate = 0.0 if deterministic else self.attention_dropout
        return SBMOptions(law=self.edge_law, dropout_rate=rate, **same)

    def paths_for(self, batch: int, length: int) -> tuple[tuple[int, ...], bool]:
        """:func:`choose_paths` under this module's options for a ``[batch, length]``
        input (the choice its call makes; a ValueError naming the fields when no path
        fits): what a config check runs for each batch a training run will trace. With
        ``impl="streamed"``: :func:`plan_stream`'s per-block buffers and whether blocks
        may run dense."""
        options = self.core_options().resolved()
        return choose_paths(options, batch=batch, heads=self.num_heads, length=length)

    def validate(self) -> None:
        """Raise ValueError naming the bad field; runs before anything is traced."""
        check_fields(self)  # num_heads, head_dim, out_dim, attention_dropout
        check_int("num_clusters", self.num_clusters)
        if not isinstance(self.delta, numbers.Real) or not 0.0 <= self.delta <= 1.0:
            raise ValueError(f"delta must lie in [0, 1] (a probability), got {self.delta!r}")
        if self.cluster_init not in CLUSTER_INITS:
            raise ValueError(f"cluster_init={self.cluster_init!r} is not one of {CLUSTER_INITS}")
        self.core_options().validate()  # the core's options, named as this module's fields

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

        if not self.has_rng("sample"):
            raise ValueError(
                "SBMAttention samples its graph from the 'sample' rng stream: pass "
                "rngs={'sample': key} to apply (it stays on at evaluation)"
            )
        options = self.core_options(deterministic)
        # Heads-major from here on ([B, H, L, hd]): the core takes that layout, and the
        # memberships ([B, H, L, k], 4x wider at k=128, hd=32) then come out of their
        # einsum in it, with no transpose of theirs in either pass.
        q, kk, v = (t.transpose(0, 2, 1, 3) for t in (q, kk, v))
        want_maps = self.is_mutable_collection(MAPS_COLLECTION) and not self.is_initializing()

        def body(q, kk, v, w1, b1, w2, b2, clusters, mask, sample_rng, dropout_rng):
            with jax.named_scope(MEMBERSHIPS):
                q_memb, k_memb, block = memberships(
                    q, kk, w1, b1, w2, b2, clusters, shared_mlp=self.shared_mlp
                )
            out, stats = sbm_attention_core(
                sample_rng,
                q,
                kk,
                v,
                q_memb,
                block,
                k_memb,
                mask,
                delta=0.0 if deterministic else self.delta,
                dropout_rng=dropout_rng,
                options=options,
            )
            sg = jax.lax.stop_gradient  # logged, not trained
            densities = expected_token_densities(sg(q_memb), sg(block), sg(k_memb), mask)
            maps = (q_memb, k_memb, block) if want_maps else None
            return out, stats, densities, maps

        # Recomputed in the backward pass from the projections: the memberships and Y S
        # ([B, H, L, k] each, 4x the projections at k=128) are not kept between the
        # passes; the core keeps only its named values (sampled keys, out and lse). The
        # recomputation waits for the cotangent on every backend (XLA:CPU drops the
        # barrier jax.checkpoint relies on: sbm_jax._remat).
        remat = recompute_after_cotangent(
            jax.checkpoint(body, policy=SPARSE_BRANCH_POLICY),
            gate_size=max(a.size for a in (w1, b1, w2, b2, clusters)),
        )
        out, stats, (query_density, key_density), maps = remat(
            q,
            kk,
            v,
            w1,
            b1,
            w2,
            b2,
            clusters,
            mask,
            self.make_rng("sample"),
            self.make_rng("dropout") if options.dropout_rate > 0.0 else None,
        )
        for name in ("density", "edges", "overflow", "path"):
            self.sow(STATS_COLLECTION, name, stats[name])
        self.sow(STATS_COLLECTION, "query_density", query_density)
        self.sow(STATS_COLLECTION, "key_density", key_density)
        if maps is not None:
            q_memb, k_memb, block = maps
            real = mask[:, None, :, None]
            self.sow(MAPS_COLLECTION, "q_memberships", jnp.where(real, q_memb, 0.0))
            self.sow(MAPS_COLLECTION, "k_memberships", jnp.where(real, k_memb, 0.0))
            self.sow(MAPS_COLLECTION, "block", block)
        out = out.transpose(0, 2, 1, 3).astype(self.dtype)  # [B, L, H, hd]
        return out_dense(out_dim, self.dtype)(out)
