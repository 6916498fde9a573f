"""The edge-list graph that the sampler produces and the edge kernels consume."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from sbm_jax._pytree import PyTreeDataclass


class EdgeList(PyTreeDataclass):
    """A bipartite query -> key graph with a static number of slots ``C``.

    Layout contract (kernels rely on it): valid edges come first, sorted by
    ``(row, col)`` with no duplicates; empty slots follow with ``valid=False``, their
    rows kept non-decreasing (they hold ``n - 1``) and arbitrary columns. Empty slots
    contribute nothing to any kernel.

    Attributes:
      rows: ``[C] int32`` query index of each slot.
      cols: ``[C] int32`` key index of each slot.
      valid: ``[C] bool`` whether the slot holds an edge.
      probs: ``[C] float32`` SBM edge probability ``p_ij = Qhat_i S Khat_j^T`` (without
        the exploration ``delta``); 0 in empty slots.
      num_edges: ``[] int32`` number of valid (unique) edges.
      num_draws: ``[] int32`` Poisson draws of fastRG before duplicates were collapsed.
      overflow: ``[] bool`` True when the draws exceeded the capacity, so edges were lost.
    """

    rows: jax.Array
    cols: jax.Array
    valid: jax.Array
    probs: jax.Array
    num_edges: jax.Array = dataclasses.field(default_factory=lambda: np.int32(0))
    num_draws: jax.Array = dataclasses.field(default_factory=lambda: np.int32(0))
    overflow: jax.Array = dataclasses.field(default_factory=lambda: np.bool_(False))

    @property
    def capacity(self) -> int:
        """Number of slots ``C`` (static)."""
        return self.rows.shape[-1]
