"""Fast edge-attention implementations behind ``edge_attention(..., impl=...)``.

Every kernel has the contract of :func:`sbm_jax.edge_ops.edge_attention` (the
``"segment"`` reference) and is tested against it and against
:func:`sbm_jax.edge_ops.dense_masked_attention` in ``tests/test_kernels.py``.

* ``"rows"``: virtual rows of the row-sorted edge list streamed in blocks, with a
  flash-style ``custom_vjp`` (see :mod:`sbm_jax.kernels.rows`). Pure JAX.
* ``"triton"``: the same virtual rows as one Pallas kernel program per block, lowered
  through Triton, for NVIDIA GPUs only (see :mod:`sbm_jax.kernels.triton`).

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


def triton_edge_attention(*args, **kwargs):
    """:func:`sbm_jax.kernels.triton.triton_edge_attention`, imported on first use (it
    imports Pallas' Triton lowering, which a CPU or TPU run never needs)."""
    from sbm_jax.kernels.triton import triton_edge_attention as kernel

    return kernel(*args, **kwargs)


#: impl name -> function with the signature of ``edge_attention`` minus ``impl``.
KERNELS = {"rows": rows_edge_attention, "triton": triton_edge_attention}
#: Kernels that run on one backend only (refused elsewhere before tracing).
KERNEL_BACKENDS = {"triton": "gpu"}

__all__ = [
    "DEFAULT_BLOCK_SLOTS",
    "EDGE_KERNEL_RESIDUAL_NAMES",
    "KERNELS",
    "KERNEL_BACKENDS",
    "RowBlocks",
    "default_block_slots",
    "default_slots_per_row",
    "row_blocks",
    "rows_edge_attention",
    "triton_edge_attention",
]
