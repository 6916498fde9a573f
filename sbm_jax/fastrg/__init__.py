"""fastRG (Rohe et al.; paper Alg. 1) under ``jit``: SBM -> EdgeList in O(edges).

The sampler works on a static number of slots (the capacity). It draws a Poisson
number of (query, key) pairs per query row (so the slots come out grouped by row),
chooses each draw's key cluster by inverse CDF over the row's ``k + 1`` cluster
weights and its key by inverse CDF inside that cluster, collapses duplicates by
sorting, and returns the edges in the layout of
:class:`sbm_jax.graph.EdgeList`. :func:`sample_edge_keys` returns the sorted edge keys
alone (what the attention layer keeps for its backward pass);
:func:`sbm_jax.ste.edge_probs_straight_through` (re-exported here) gives the layer eq.
9's estimator of ``p_e`` without computing ``p_e`` (its gradient is two SpMMs with ``k``
columns).

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

One module per concern: :mod:`~sbm_jax.fastrg.plan` (the :class:`SamplingPlan`: rates,
bound, tables), :mod:`~sbm_jax.fastrg.search` (the CDFs, guide tables and guided
searches), :mod:`~sbm_jax.fastrg.sampler` (the draw, the collapse, the thinning and the
edge list) and :mod:`~sbm_jax.fastrg.dense_mask` (the same law drawn pair by pair). This
package re-exports their public names: import them from ``sbm_jax.fastrg``.
"""

from __future__ import annotations

from sbm_jax.fastrg.dense_mask import dense_probs, sample_dense_mask
from sbm_jax.fastrg.plan import (
    BERNOULLI_MAX_BOUND,
    LAWS,
    SamplingPlan,
    check_law,
    draw_row_counts,
    make_plan,
    needs_dense,
    row_max_bound,
    split_count,
    with_tables,
)
from sbm_jax.fastrg.sampler import (
    EDGE_PROB_CHUNK,
    PREFIX_ALIGN,
    PREFIX_MIN_CAPACITY,
    PREFIX_STEPS,
    SEARCH_CHUNK,
    THIN_BUDGET,
    edge_probs,
    edges_from_keys,
    prefix_sizes,
    sample_edge_keys,
    sample_from_plan,
    sample_sbm_graph,
)
from sbm_jax.fastrg.search import (
    CDF_METHODS,
    CDF_ONE_PASS,
    GUIDE_SPAN,
    ROW_GUIDE_SPAN,
    ROW_SEARCH_WINDOW,
    SEARCH_WINDOW,
    cdf_method,
    padded_cdf,
    weight_cdf,
)
from sbm_jax.ste import STE_CHUNK, edge_probs_straight_through

__all__ = [
    "BERNOULLI_MAX_BOUND",
    "CDF_METHODS",
    "CDF_ONE_PASS",
    "EDGE_PROB_CHUNK",
    "GUIDE_SPAN",
    "LAWS",
    "PREFIX_ALIGN",
    "PREFIX_MIN_CAPACITY",
    "PREFIX_STEPS",
    "ROW_GUIDE_SPAN",
    "ROW_SEARCH_WINDOW",
    "SEARCH_CHUNK",
    "SEARCH_WINDOW",
    "STE_CHUNK",
    "THIN_BUDGET",
    "SamplingPlan",
    "cdf_method",
    "check_law",
    "dense_probs",
    "draw_row_counts",
    "edge_probs",
    "edge_probs_straight_through",
    "edges_from_keys",
    "make_plan",
    "needs_dense",
    "padded_cdf",
    "prefix_sizes",
    "row_max_bound",
    "sample_dense_mask",
    "sample_edge_keys",
    "sample_from_plan",
    "sample_sbm_graph",
    "split_count",
    "weight_cdf",
    "with_tables",
]
