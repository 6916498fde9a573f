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
      num_rows, num_cols: the graph's ``n`` queries and ``m`` keys (static; ``None`` when
        the maker did not say). The sampler sets them, and the edge kernels check them
        against ``q`` and ``k``: an out-of-range index would otherwise be clamped or
        dropped silently under ``jit``.
    """

    rows: jax.Array
    cols: jax.Array
    valid: jax.Array
    probs: jax.Array
    # numpy scalars as defaults: no jax array is made at import (they become arrays in jit).
    num_edges: jax.Array = dataclasses.field(default_factory=lambda: np.int32(0))  # type: ignore[assignment]
    num_draws: jax.Array = dataclasses.field(default_factory=lambda: np.int32(0))  # type: ignore[assignment]
    overflow: jax.Array = dataclasses.field(default_factory=lambda: np.bool_(False))  # type: ignore[assignment]
    num_rows: int | None = dataclasses.field(default=None, metadata={"static": True})
    num_cols: int | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def capacity(self) -> int:
        """Number of slots ``C`` (static)."""
        return self.rows.shape[-1]

    def check_operands(
        self,
        num_queries: int,
        num_keys: int,
        **per_slot: jax.Array | None,
    ) -> None:
        """Raise a ValueError unless ``q`` has the graph's ``num_rows`` rows, ``k`` its
        ``num_cols`` (where the graph records them), and every array in ``per_slot``
        (``edge_scale=...``; ``None`` skipped) is ``[C]``."""
        if self.num_rows is not None and num_queries != self.num_rows:
            raise ValueError(
                f"q has {num_queries} rows but the graph was sampled for {self.num_rows} queries"
            )
        if self.num_cols is not None and num_keys != self.num_cols:
            raise ValueError(
                f"k has {num_keys} rows but the graph was sampled for {self.num_cols} keys"
            )
        for name, array in per_slot.items():
            if array is not None and tuple(array.shape) != (self.capacity,):
                raise ValueError(
                    f"{name} must be [C] = [{self.capacity}] (one per slot), got {array.shape}"
                )
