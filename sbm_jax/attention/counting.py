"""Building blocks of the mechanisms' analytic FLOP and parameter counts (pure Python).

Each registered mechanism defines its ``flops`` and ``params`` functions next to its
module (see ``registry.Mechanism``) from these pieces; the counting conventions are in
``sbm_jax.analysis.flops``. Symbols: ``n`` length, ``D`` model width, ``H`` heads, ``d``
head width.
"""

from __future__ import annotations

from collections.abc import Sequence

SOFTMAX = 5.0  # FLOPs per softmax entry: max, subtract, exp, sum, divide


def projection_flops(n: int, D: int, H: int, d: int, inputs: int = 3) -> dict[str, float]:
    """Per-head input projections (``inputs`` of Q, K, V; 2 with a shared QK) and ``out``.

    ``qkv_projection = inputs * 2nDHd``, ``out_projection = 2nHdD``.
    """
    return {
        "qkv_projection": inputs * 2.0 * n * D * H * d,
        "out_projection": 2.0 * n * H * d * D,
    }


def projection_params(D: int, H: int, d: int, inputs: int = 3, out_dim: int | None = None) -> int:
    """Parameters of ``inputs`` ``DenseGeneral(D -> [H, d])`` and ``out`` ``([H, d] -> D)``.

    All with biases; ``out_dim`` defaults to ``D``.
    """
    out_dim = D if out_dim is None else out_dim
    return inputs * (D * H * d + H * d) + (H * d * out_dim + out_dim)


def edge_flops(edges: Sequence[float], n: int, d: int) -> dict[str, float]:
    """Softmax attention over ``edges[h]`` (query, key) pairs per head.

    ``scale nd`` per head; ``scores 2Ed``; ``softmax 5E``; ``aggregation 2Ed``.
    """
    total = float(sum(edges))
    return {
        "scale": len(edges) * n * d,
        "scores": 2.0 * total * d,
        "softmax": SOFTMAX * total,
        "aggregation": 2.0 * total * d,
    }
