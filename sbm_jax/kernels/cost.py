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

A cost that was never measured is absent from the table, never borrowed from another
backend: :func:`edge_cost` returns ``None`` for it. With no cost, ``impl="auto"`` keeps
no sparse bucket where the dense path is allowed (the dense path is exact for the same
law, and matrix products are what an accelerator without a measured gather cost is
known to run well) and warns once, naming the calibration command.
``kernel="auto"`` (:func:`resolve_kernel`) takes the cheapest *measured* kernel of the
backend that can run there, and ``"rows"`` (which runs everywhere) when none is.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax

#: Cost of one sparse slot in dense-branch pairs (forward + backward), per backend and
#: kernel, measured with ``scripts/benchmark_attention.py --calibrate 2048 --impls rows
#: segment`` (B=2, H=2, d_h=32, k=128, n=2048, 5% density in a bucket of 10% of n^2,
#: float32; docs/benchmarks.md). ``fused`` (CPU only) costs one sampled edge, not a
#: slot (``--calibrate 2048 4096 --impls fused``): a batch whose draws times it reach
#: its pairs runs the dense path. ``cpu``: a 2-core x86 CPU; buckets below ~1/8 of n*m
#: run sparse with ``rows`` (the defaults 1/64 and 1/16, not 1/4), below ~1/15 with
#: ``segment``. ``gpu``: an NVIDIA H100; only buckets below ~1/51 of n*m run sparse (the
#: default 1/64), since the dense branch is matrix products and the sparse one gathers,
#: sorts and scatters. The ``triton`` kernel
#: (GPU only) is not measured yet: ``scripts/accelerator_check.py`` measures it with the
#: rest of the GPU table. ``tpu``: nothing measured (no TPU was available), so no entry.
EDGE_COST: dict[str, dict[str, float]] = {
    "cpu": {"rows": 7.6, "segment": 15.3, "fused": 8.2},
    "gpu": {"rows": 51.0, "segment": 88.0},
    "tpu": {},
}

#: Bucket slots per sampled edge when ``kernel="auto"`` compares kernels: a bucket kernel's
#: cost is per slot of its bucket, which the calibration fills about half (as buckets 4x
#: apart are), the fused kernel's per sampled edge (it has no buckets).
SLOTS_PER_EDGE = 2.0

#: Kernels that run on one backend only (:data:`sbm_jax.kernels.KERNEL_BACKENDS`).
_ONLY_ON = {"triton": "gpu", "fused": "cpu"}
#: Every kernel name the cost model knows (``"segment"``, the fast edge kernels and the
#: fused CPU kernel, whose unit is one Poisson draw rather than one bucket slot).
KNOWN_KERNELS = ("rows", "segment", "triton", "fused")
_warned: set[tuple[str, str]] = set()


def edge_cost(kernel: str, backend: str | None = None) -> float | None:
    """Measured cost of one sparse slot with ``kernel`` on ``backend`` (default: JAX's),
    in pairs of the dense branch; ``None`` where it was never measured."""
    backend = jax.default_backend() if backend is None else backend
    if kernel not in KNOWN_KERNELS:
        raise ValueError(f"kernel={kernel!r} has no calibrated cost; known: {KNOWN_KERNELS}")
    return EDGE_COST.get(backend, {}).get(kernel)


def resolve_kernel(kernel: str, backend: str | None = None) -> str:
    """The edge kernel the layer runs for ``kernel`` on ``backend`` (default: JAX's).

    ``"auto"``: the measured-cheapest kernel that runs on the backend, ``"rows"`` where
    none is measured. A kernel bound to one backend (``"triton"``: GPU) raises a
    ValueError naming the option and the backend elsewhere (see
    :func:`sbm_jax.kernels.triton.check_backend` for the interpret and lowering modes).
    """
    backend = jax.default_backend() if backend is None else backend
    if kernel == "auto":
        measured = {
            name: cost * (1.0 if name == "fused" else SLOTS_PER_EDGE)
            for name, cost in EDGE_COST.get(backend, {}).items()
            if _ONLY_ON.get(name, backend) == backend and _usable(name)
        }
        return min(measured, key=measured.__getitem__) if measured else "rows"
    if kernel == "triton":
        from sbm_jax.kernels.triton import check_backend

        check_backend(backend)
    if kernel == "fused":
        if backend != "cpu":
            raise ValueError(
                f"kernel='fused' is the native CPU kernel (XLA:CPU through the XLA FFI) and "
                f"cannot run on backend {backend!r}; use kernel='auto' (or 'rows')"
            )
        from sbm_jax.kernels.fused import fused_status

        ok, why = fused_status()
        if not ok:
            raise ValueError(f"kernel='fused' is unavailable here: {why}; use kernel='rows'")
    return kernel


def _usable(kernel: str) -> bool:
    """Whether ``kernel`` can run in this process: the fused CPU kernel needs its native
    library (built on first use), and ``auto`` falls back with one warning where the
    build fails."""
    if kernel != "fused":
        return True
    from sbm_jax.kernels.fused import fused_status

    ok, why = fused_status()
    if not ok and ("fused", "unavailable") not in _warned:
        _warned.add(("fused", "unavailable"))
        warnings.warn(
            f"kernel='auto' takes 'rows' on this CPU: the fused kernel is unavailable ({why})",
            stacklevel=3,
        )
    return ok


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
    Without a measured cost (nor ``slot_cost``), every bucket is marked False (the dense
    path), with a warning once per backend and kernel.
    """
    backend = jax.default_backend() if backend is None else backend
    cost = edge_cost(kernel, backend) if slot_cost is None else float(slot_cost)
    if cost is None:
        if (backend, kernel) not in _warned:
            _warned.add((backend, kernel))
            warnings.warn(
                f"kernel={kernel!r} has no measured cost on backend {backend!r}: impl='auto' "
                "runs the dense path; measure it with scripts/benchmark_attention.py "
                "--calibrate, or set SBMAttention.edge_cost",
                stacklevel=2,
            )
        return tuple(False for _ in capacities)
    return tuple(c * cost < n * m for c in capacities)
