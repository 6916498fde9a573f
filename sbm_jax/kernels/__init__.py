"""Fast edge-attention implementations behind ``edge_attention(..., impl=...)``.

Every kernel has the contract of :func:`sbm_jax.edge_ops.edge_attention` (the
``"segment"`` reference) and is tested against it and against
:func:`sbm_jax.edge_ops.dense_masked_attention` in ``tests/test_kernels.py``.

* ``"rows"``: virtual rows of the row-sorted edge list streamed in blocks, with a
  flash-style ``custom_vjp`` (see :mod:`sbm_jax.kernels.rows`). Pure JAX.

Also here: :mod:`sbm_jax.kernels.dense`, the layer's dense path streamed over query
blocks, and :mod:`sbm_jax.kernels.cost`, the layer's calibrated path cost model.
"""

from __future__ import annotations

from sbm_jax.kernels.rows import (
    DEFAULT_BLOCK_SLOTS,
    EDGE_KERNEL_RESIDUAL_NAMES,
    RowBlocks,
    default_block_slots,
    default_slots_per_row,
    row_blocks,
    rows_edge_attention,
)

#: impl name -> function with the signature of ``edge_attention`` minus ``impl``.
KERNELS = {"rows": rows_edge_attention}

__all__ = [
    "DEFAULT_BLOCK_SLOTS",
    "EDGE_KERNEL_RESIDUAL_NAMES",
    "KERNELS",
    "RowBlocks",
    "default_block_slots",
    "default_slots_per_row",
    "row_blocks",
    "rows_edge_attention",
]
