"""Trip counts of loops that follow the data, kept unbatched under ``vmap``.

The edge kernels, the straight-through backward and fastRG's streamed searches loop
only over the chunks that hold edges (``lax.fori_loop`` with a traced trip count), so
that their work follows the sampled graph rather than its capacity. Under ``vmap`` (the
layer maps its graphs that way on accelerators) that trip count differs per graph, and
JAX batches such a loop by running it until the longest graph is done and *selecting*
every carry on every step (old value for the graphs already done, new for the rest).
The carries are the loops' accumulators (``[m, d]`` key and value gradients, the
``[n, k]`` and ``[m, k]`` membership gradients): each select is a pass over them, and
XLA keeps both versions alive, so the kernels' compiled temporary memory grows past what
a fixed trip count needs (measured figures: docs/log.md, "Code comments (dated figures)").

:func:`shared_trip_count` gives such a loop the largest trip count over the mapped axes
instead, unbatched, so that no select is needed. It is only correct for loops whose
steps past a graph's own count change nothing (they read empty slots: zero-length
virtual rows, zero cotangents) or whose extra outputs nobody reads; every caller says
why its loop is one of those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_batching.custom_vmap
def shared_trip_count(count: jax.Array) -> jax.Array:
    """``count`` (an integer scalar) unchanged; under ``vmap``, its maximum over the
    mapped axes, unbatched (nested ``vmap`` fold in one axis each)."""
    return count


@shared_trip_count.def_vmap
def _largest_over_batch(axis_size, in_batched, count):
    del axis_size
    (batched,) = in_batched
    if not batched:
        return shared_trip_count(count), False
    # Called again, so that an outer vmap folds its own axis in too.
    return shared_trip_count(jnp.max(count, axis=0)), False
