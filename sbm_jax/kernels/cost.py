"""A static cost model: is a sparse capacity bucket cheaper than the dense path?

The SBM layer runs one ``lax.switch`` branch per capacity bucket plus a dense branch.
Capacities are static, so whether a bucket should run sparse or dense is a static
decision: a bucket whose sparse cost exceeds the dense path's cost can simply *be* the
dense branch (same law, exact), and no runtime cost model is needed inside the switch.

Costs are in units of one dense attention score (forward + backward of ``q.k``, softmax
and ``w.v``, as ``dense_masked_attention`` does it). Calibrated with
``scripts/benchmark_attention.py`` on a 2-core x86 CPU (JAX 0.10.2, n=4096, d_h=32,
float32, fwd+bwd, against ``dense_masked_attention``): the ``rows`` kernel cost 10-12
dense scores per slot at 1-5% density, the ``segment`` reference ~25 (see
``docs/benchmarks.md``). With ``k = 128`` the SBM dense path costs ~3 units per pair, so
on this CPU ``rows`` beats it below ~30% of ``n m`` slots and ``segment`` below ~12%.
Recalibrate per backend with the script.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Cost of one edge slot, in dense scores, per kernel (CPU calibration).
SLOT_COST_IN_DENSE_SCORES = {"segment": 25.0, "rows": 11.0}


def sparse_cost(capacity: int, kernel: str) -> float:
    """Cost of a sparse branch with ``capacity`` slots, in dense-score units."""
    if kernel not in SLOT_COST_IN_DENSE_SCORES:
        raise ValueError(
            f"kernel={kernel!r} has no calibrated cost; known: {tuple(SLOT_COST_IN_DENSE_SCORES)}"
        )
    return capacity * SLOT_COST_IN_DENSE_SCORES[kernel]


def dense_sbm_cost(n: int, m: int, *, head_dim: int, num_clusters: int) -> float:
    """Cost of the SBM dense path: attention plus ``p = Qhat S Khat^T`` (``n m k``).

    Dense attention does two ``n m d`` products; the probability matrix adds one
    ``n m k`` product, i.e. ``k / (2 d)`` dense-score units per pair.
    """
    return n * m * (1.0 + num_clusters / (2.0 * head_dim))


def sparse_buckets_worth_it(
    capacities: Sequence[int],
    n: int,
    m: int,
    *,
    head_dim: int,
    num_clusters: int,
    kernel: str,
) -> tuple[bool, ...]:
    """For each bucket, True when its sparse branch is estimated cheaper than dense.

    A layer can map the buckets marked False to its dense branch (same law, exact), so
    that SBM attention is never much slower than its own dense path.
    """
    dense = dense_sbm_cost(n, m, head_dim=head_dim, num_clusters=num_clusters)
    return tuple(sparse_cost(c, kernel) < dense for c in capacities)
