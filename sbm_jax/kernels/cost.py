"""The SBM layer's static cost model: is a sparse capacity bucket cheaper than the dense path?

The SBM layer runs one ``lax.switch`` branch per capacity bucket plus a dense branch.
Capacities are static, so whether a bucket should run sparse or dense is a static
decision: a bucket whose sparse branch costs more than the dense branch can simply be
left out (its draws then take the dense branch: same law, exact), and no runtime cost
model is needed inside the switch. ``SBMAttention(impl="auto")`` calls
:func:`sparse_buckets_worth_it` with the calibration of the backend it runs on; this is
the only cost model of the layer.

The unit is one pair ``(i, j)`` of the layer's dense branch
(:mod:`sbm_jax.kernels.dense`: ``p``, mask, masked softmax, eq. 9 backward, forward +
backward). :data:`EDGE_COST` is the measured cost of one *slot* of a sparse branch
(fastRG, edge list, edge kernel, straight-through SpMMs, forward + backward) in that
unit, per backend and kernel: a bucket of ``C`` slots is worth running sparse when
``C * edge_cost < n * m``. ``scripts/benchmark_attention.py --calibrate`` measures it
(the whole layer with ``impl="dense"`` against ``impl="sparse"`` with one bucket, in one
process) and prints the table row for the backend it runs on.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

#: Cost of one sparse slot in dense-branch pairs (forward + backward), per backend and
#: kernel, measured with ``scripts/benchmark_attention.py --calibrate 2048 --impls rows
#: segment`` (B=2, H=2, d_h=32, k=128, n=2048, 5% density in a bucket of 10% of n^2,
#: float32; docs/benchmarks.md). ``cpu``: a shared 2-core x86 CPU, JAX 0.10.2,
#: recalibrated 2026-11-29 on 56b59f5 (fastRG on prefixes of its bucket, the dense
#: path's faster backward): rows 7.5, 8.0, 7.4, segment 15.2, 15.7, 15.1 in three runs
#: (rows 10.3 and 8.0, segment 30.9 on 2026-11-27); buckets below ~1/8 of n*m run sparse
#: with ``rows`` (the defaults 1/64 and 1/16, not 1/4), below ~1/15 with ``segment``.
#: ``gpu``: one NVIDIA H100 80GB, JAX 0.11.2 (2026-11-27): rows 50.8, segment 87.6;
#: only buckets below ~1/51 of n*m run sparse (the default 1/64), since the dense branch
#: is matrix products and the sparse one gathers, sorts and scatters. ``tpu``: NOT
#: measured (no TPU was available); it takes the GPU's figures, on the expectation that
#: gathers and scatters cost a TPU at least as much. Recalibrate there with
#: ``--calibrate``.
EDGE_COST: dict[str, dict[str, float]] = {
    "cpu": {"rows": 7.6, "segment": 15.3},
    "gpu": {"rows": 51.0, "segment": 88.0},
    "tpu": {"rows": 51.0, "segment": 88.0},
}


def edge_cost(kernel: str, backend: str | None = None) -> float:
    """Cost of one sparse slot with ``kernel`` on ``backend`` (default: JAX's), in pairs of
    the dense branch. Unknown backends use the ``gpu`` figures."""
    backend = jax.default_backend() if backend is None else backend
    table = EDGE_COST.get(backend, EDGE_COST["gpu"])
    if kernel not in table:
        raise ValueError(f"kernel={kernel!r} has no calibrated cost; known: {tuple(table)}")
    return table[kernel]


def sparse_buckets_worth_it(
    capacities: Sequence[int],
    n: int,
    m: int,
    *,
    kernel: str,
    backend: str | None = None,
    slot_cost: float | None = None,
) -> tuple[bool, ...]:
    """For each bucket, True when its sparse branch is estimated cheaper than the dense one.

    ``slot_cost`` overrides the calibration (``SBMAttention.edge_cost``): the cost of one
    slot in pairs of the dense branch. The layer leaves the buckets marked False out of
    its switch, so that SBM attention is never much slower than its own dense path.
    """
    cost = edge_cost(kernel, backend) if slot_cost is None else float(slot_cost)
    return tuple(c * cost < n * m for c in capacities)
