"""Parameter counts and analytic per-example FLOPs of every attention mechanism.

Parameters come from an actual ``init`` of the registered module (traced with
``jax.eval_shape``, so nothing is computed or allocated). FLOPs are counted by hand,
per operation, for ONE example (batch 1) of length ``n`` with no padding, for the
attention layer only (its own projections included; the encoder's MLP and LayerNorms
are not). Conventions:

* a multiply-add is 2 FLOPs, so a ``[a, b] @ [b, c]`` product costs ``2abc``;
* every elementwise op (add, multiply, divide, exp, max, relu, sigmoid, elu) costs 1;
  a softmax over a row costs 5 per entry (max, subtract, exp, sum, divide);
* costs that do not depend on the example (drawing Performer's random features, SBM's
  block matrix ``S``, the damping graph of TSA) are included once, as if the batch held
  one example: they are an upper bound of the per-example share;
* sorting (Reformer) is counted as ``n log2 n`` comparisons per hash round;
* index bookkeeping (gathers, scatters, masks, reshapes) costs 0.

Symbols: ``n`` length, ``D`` model width (``emb_dim``), ``H`` heads, ``d`` head width;
every per-head cost below is multiplied by ``H``.

=================  =======================================================================
mechanism          per-operation FLOPs (per head unless the op says otherwise)
=================  =======================================================================
all (projections)  ``qkv_projection = 3 * 2nDHd`` (Reformer: 2, shared QK);
                   ``out_projection = 2nHdD`` (total over heads)
full               ``scale nd``; ``scores 2n^2 d``; ``softmax 5n^2``; ``aggregation 2n^2 d``
linear             ``feature_map 2 * 3nd`` (elu, +1 on Q and K); ``kv 2nd^2``;
                   ``normaliser nd + 2nd`` (key sum, phi(Q) . sum); ``aggregation 2nd^2``;
                   ``divide nd``
performer (m)      ``scale 2nd``; ``feature_map 2 * 2ndm`` (x W^T for Q, K) plus, per entry
                   of the 2 nm features, 4 (softmax kernel: -|x|^2/2, -shift, exp, +eps,
                   ``*1/sqrt(m)``; 2nd for the norms) or 3 (relu kernel: relu, +eps, scale);
                   ``random_features`` (orthogonal: QR ``4/3 d^3`` per block of d rows);
                   ``kv 2nmd``; ``normaliser nm + 2nm``; ``aggregation 2nmd``; ``divide nd``
linformer (k)      ``sequence_projection 2 * 2nkd`` (E^T K, F^T V); ``scale nd``;
                   ``scores 2nkd``; ``softmax 5nk``; ``aggregation 2nkd``
nystromformer      ``s = ceil(n / L)``, ``m = ceil(n / s)`` landmarks. ``scale 2nd``;
                   ``landmarks 2(nd + md)`` (segment sums and means of Q and K);
                   ``scores 2nmd + 2m^2 d + 2mnd`` (three kernels); ``softmax 5(nm + m^2 + mn)``;
                   ``pinv 3m^2 + I (10 m^3 + 4 m^2)`` (I iterations, 5 products each);
                   ``aggregation 2mnd + 2m^2 d + 2nmd`` (right to left);
                   ``conv 2ndK`` (depthwise skip, kernel K, 0 when off)
reformer           rounds R, chunk ``c = min(chunk_len, n)``, ``nc = ceil(n / c)`` chunks,
                   ``w = 2c`` keys per chunk (``c`` when ``nc = 1``), b buckets.
                   ``hashing R (2nd b/2 + nb)`` (0 when b = 1); ``key_norm 3nd``;
                   ``sort R n log2 n``; ``scores R 2 nc c w d``; ``softmax R 5 nc c w``;
                   ``aggregation R 2 nc c w d``; ``combine_rounds 5nR + 2nRd``
local (w)          ``r = w // 2``, blocks ``b = max(1, min(r, n))``, ``nb = ceil(n / b)``,
                   ``kw = 3b`` keys per block (``b`` when ``nb = 1``): ``scale nd``;
                   ``scores 2 nb b kw d``; ``softmax 5 nb b kw``; ``aggregation 2 nb b kw d``
sparse_strided,    E = attended (query, key) pairs of the head's pattern (closed-form row
sparse_fixed       counts, see ``pattern_edges``): ``scale nd``; ``scores 2Ed``;
                   ``softmax 5E``; ``aggregation 2Ed``. This is the algorithmic cost; the
                   default ``impl="blocked"`` executes the scores of the blocks it
                   gathers (a small multiple of E, e.g. 3l keys per query for the
                   strided band that keeps 2l + 1); ``impl="mask"`` full attention's.
sbm (k clusters,   E = density n^2 sampled edges. ``memberships_mlp 2 (2 * 2nd^2 + 3nd)``
density rho)       (two-layer MLP with biases and relu on Q and K);
                   ``memberships 2 (2nkd + nk)`` (x C^T, sigmoid);
                   ``block_matrix 2k^2 d + 5k^2`` (S = softmax(C C^T));
                   ``expected_edges 2nk^2 + 2nk + 2k^2`` (Y S, column sums, bilinear form);
                   ``edge_sampling E (log2 k^2 + 2 log2 n + 2k + 2)`` (inverse-CDF picks of
                   block and nodes, p_ij = (YS)_i . z_j, keep test); ``ste E``;
                   ``scale nd``; ``scores 2Ed``; ``softmax 5E``; ``aggregation 2Ed``
tsa                ``key/value projections``: TT (``2 sum_n R_{n-1} I_n J_n R_n
                   prod_{k<n} J_k prod_{k>n} I_k`` per row, per head) or dense ``2nDd``;
                   ``scores 2n^2 d``; ``graph 4n^2`` (scale, relu, x Omega, mask);
                   ``filter 2n^2 d + nd`` ((I + Psi) V); ``out_projection`` TT or 2nHdD
=================  =======================================================================
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sbm_jax.attention import available, build_attention, get_attention
from sbm_jax.attention.sparse_patterns import default_summary_cells
from sbm_jax.layers.tt import tt_core_shapes, tt_modes, tt_ranks

SOFTMAX = 5.0  # FLOPs per softmax entry: max, subtract, exp, sum, divide


def _options(name: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The mechanism's options: its class defaults overridden by ``options``."""
    cls = get_attention(name, field="mechanism")
    fields = getattr(cls, "__dataclass_fields__", {})
    merged = {k: f.default for k, f in fields.items() if k not in ("parent", "name")}
    for key, value in dict(options or {}).items():
        if key not in fields:
            raise ValueError(
                f"options.{key} is not an option of attention {name!r}; "
                f"its options are {sorted(set(merged) - {'num_heads', 'head_dim', 'out_dim'})}"
            )
        merged[key] = value
    return merged


def _check_shape(seq_len: int, emb_dim: int, num_heads: int, head_dim: int) -> None:
    for field, value in (
        ("seq_len", seq_len),
        ("emb_dim", emb_dim),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive integer")


def attention_param_count(
    name: str,
    *,
    emb_dim: int,
    num_heads: int,
    head_dim: int,
    seq_len: int,
    options: Mapping[str, Any] | None = None,
) -> int:
    """Parameters of one attention layer, from an abstract ``init`` of the registered module.

    The module is initialised on an abstract input ``[1, seq_len, emb_dim]`` (some
    mechanisms, such as Linformer, own sequence-length-sized parameters).
    """
    _check_shape(seq_len, emb_dim, num_heads, head_dim)
    module = build_attention(
        name,
        options=dict(options or {}),
        num_heads=num_heads,
        head_dim=head_dim,
        out_dim=emb_dim,
    )
    x = jax.ShapeDtypeStruct((1, seq_len, emb_dim), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, seq_len), jnp.bool_)
    key = jax.random.PRNGKey(0)
    rngs = {"params": key, "sample": key, "dropout": key}
    shapes = jax.eval_shape(lambda a, m: module.init(rngs, a, m, deterministic=True), x, mask)
    return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes.get("params", {}))))


# ---------------------------------------------------------------------------------------
# Sparse Transformer pattern sizes (closed-form row counts, no n x n array).


def default_stride(n: int) -> int:
    """The stride the sparse mechanisms use by default: ``max(1, round(sqrt(n)))``."""
    return max(1, round(math.sqrt(n)))


def _summary_residues(stride: int, c: int, offset: int) -> np.ndarray:
    """Residues ``j mod l`` of the fixed pattern's summary cells (type-B heads)."""
    rho = np.arange(stride)
    return rho[((stride - 1 - offset - rho) % stride) < c]


def _count_residues(limit: np.ndarray, residues: np.ndarray, stride: int) -> np.ndarray:
    """Per row: number of j in [0, limit] with j mod stride in ``residues``."""
    lim = limit[:, None]
    res = residues[None, :]
    return np.where(lim >= res, (lim - res) // stride + 1, 0).sum(axis=1)


def pattern_edges(
    kind: str,
    n: int,
    num_heads: int,
    *,
    stride: int | None = None,
    c: int | None = None,
    causal: bool = False,
    distinct_summaries: bool = False,
) -> list[int]:
    """Attended (query, key) pairs of each head of a Sparse Transformer pattern.

    ``kind`` is ``"strided"`` or ``"fixed"``; heads split as the mechanisms do (one head:
    union of types A and B; otherwise the first ceil(H/2) heads A, the rest B).
    Returns one count per head, computed from per-row closed forms in O(n * stride).
    """
    if kind not in ("strided", "fixed"):
        raise ValueError(f"kind={kind!r} must be 'strided' or 'fixed'")
    stride = default_stride(n) if stride is None else int(stride)
    if stride < 1:
        raise ValueError(f"stride={stride} must be >= 1")
    i = np.arange(n, dtype=np.int64)
    if kind == "strided":
        if causal:
            a = np.minimum(i, stride) + 1
            b = i // stride + 1
            ab = 1 + (i - stride >= 0)
        else:
            a = np.minimum(i + stride, n - 1) - np.maximum(i - stride, 0) + 1
            b = (n - 1 - i % stride) // stride + 1
            ab = 1 + (i - stride >= 0) + (i + stride <= n - 1)
        a_count, b_counts = int(a.sum()), [int(b.sum())]
        union = int((a + b - ab).sum())
    else:
        c = default_summary_cells(stride) if c is None else int(c)
        if not 1 <= c <= stride:
            raise ValueError(f"c={c} must be in [1, stride={stride}]")
        start = (i // stride) * stride
        if causal:
            a = i % stride + 1
            limit = i
        else:
            a = np.minimum(stride, n - start)
            limit = np.full(n, n - 1)
        num_b = num_heads // 2 if distinct_summaries else 1
        b_counts = []
        for h in range(max(num_b, 1)):
            residues = _summary_residues(stride, c, (h * c) % stride)
            b_counts.append(int(_count_residues(limit, residues, stride).sum()))
        residues = _summary_residues(stride, c, 0)
        top = i if causal else np.minimum(start + stride - 1, n - 1)
        ab = np.zeros(n, np.int64)
        for r in residues:  # summary cells inside the query's own block
            ab += (start + r <= top).astype(np.int64)
        a_count = int(a.sum())
        union = int((a + _count_residues(limit, residues, stride) - ab).sum())
    if num_heads == 1:
        return [union]
    num_a = num_heads - num_heads // 2
    return [a_count] * num_a + [b_counts[h % len(b_counts)] for h in range(num_heads - num_a)]


# ---------------------------------------------------------------------------------------
# FLOPs per mechanism. Each returns per-op totals over all heads (projections excluded).


def _tt_row_flops(in_dim: int, out_dim: int, rank: int) -> float:
    """FLOPs of one row through a TTDense with automatic modes (see ``tt_contract``)."""
    in_modes, out_modes = tt_modes(in_dim, out_dim)
    shapes = tt_core_shapes(in_modes, out_modes, tt_ranks(len(in_modes), rank))
    total = 0.0
    for idx, (r0, i_n, j_n, r1) in enumerate(shapes):
        left = math.prod(out_modes[:idx])
        right = math.prod(in_modes[idx + 1 :])
        total += 2.0 * r0 * i_n * j_n * r1 * left * right
    return total


def _full(n, D, H, d, o, density):
    return {
        "scale": H * n * d,
        "scores": H * 2.0 * n * n * d,
        "softmax": H * SOFTMAX * n * n,
        "aggregation": H * 2.0 * n * n * d,
    }


def _linear(n, D, H, d, o, density):
    return {
        "feature_map": H * 2 * 3.0 * n * d,
        "kv": H * 2.0 * n * d * d,
        "normaliser": H * (n * d + 2.0 * n * d),
        "aggregation": H * 2.0 * n * d * d,
        "divide": H * n * d,
    }


def _performer(n, D, H, d, o, density):
    m = int(o["num_features"])
    per_feature = 4.0 if o["kernel"] == "softmax" else 3.0
    norms = 2 * 2.0 * n * d if o["kernel"] == "softmax" else 0.0
    blocks = -(-m // d)
    random_features = blocks * (4.0 / 3.0) * d**3 if o["orthogonal"] else 0.0
    return {
        "scale": H * 2.0 * n * d,
        "feature_map": H * (2 * 2.0 * n * d * m + 2 * per_feature * n * m + norms),
        "random_features": random_features,
        "kv": H * 2.0 * n * m * d,
        "normaliser": H * (n * m + 2.0 * n * m),
        "aggregation": H * 2.0 * n * m * d,
        "divide": H * n * d,
    }


def _linformer(n, D, H, d, o, density):
    k = int(o["proj_len"])
    return {
        "sequence_projection": H * 2 * 2.0 * n * k * d,
        "scale": H * n * d,
        "scores": H * 2.0 * n * k * d,
        "softmax": H * SOFTMAX * n * k,
        "aggregation": H * 2.0 * n * k * d,
    }


def _nystromformer(n, D, H, d, o, density):
    segment = -(-n // int(o["num_landmarks"]))
    m = -(-n // segment)
    iters = int(o["pinv_iterations"])
    conv = int(o["conv_kernel_size"])
    return {
        "scale": H * 2.0 * n * d,
        "landmarks": H * 2.0 * (n * d + m * d),
        "scores": H * (2.0 * n * m * d + 2.0 * m * m * d + 2.0 * m * n * d),
        "softmax": H * SOFTMAX * (n * m + m * m + m * n),
        "pinv": H * (3.0 * m * m + iters * (10.0 * m**3 + 4.0 * m * m)),
        "aggregation": H * (2.0 * m * n * d + 2.0 * m * m * d + 2.0 * n * m * d),
        "conv": H * 2.0 * n * d * conv,
    }


def _reformer(n, D, H, d, o, density):
    rounds = int(o["num_hashes"])
    c = min(int(o["chunk_len"]), n)
    nc = -(-n // c)
    w = 2 * c if nc > 1 else c
    buckets = o["num_buckets"]
    if buckets is None:
        buckets = max(2, 2 * (-(-n // int(o["chunk_len"]))))
    hashing = 0.0 if buckets == 1 else rounds * (2.0 * n * d * buckets / 2 + n * buckets)
    return {
        "hashing": H * hashing,
        "key_norm": H * 3.0 * n * d,
        "sort": H * rounds * n * math.log2(max(n, 2)),
        "scores": H * rounds * 2.0 * nc * c * w * d,
        "softmax": H * rounds * SOFTMAX * nc * c * w,
        "aggregation": H * rounds * 2.0 * nc * c * w * d,
        "combine_rounds": H * (SOFTMAX * n * rounds + 2.0 * n * rounds * d),
    }


def _local(n, D, H, d, o, density):
    r = int(o["window"]) // 2
    b = max(1, min(r, n))
    nb = -(-n // b)
    kw = 3 * b if nb > 1 else b
    return {
        "scale": H * n * d,
        "scores": H * 2.0 * nb * b * kw * d,
        "softmax": H * SOFTMAX * nb * b * kw,
        "aggregation": H * 2.0 * nb * b * kw * d,
    }


def _edge_costs(edges: Sequence[float], n: int, d: int) -> dict[str, float]:
    total = float(sum(edges))
    return {
        "scale": len(edges) * n * d,
        "scores": 2.0 * total * d,
        "softmax": SOFTMAX * total,
        "aggregation": 2.0 * total * d,
    }


def _sparse_strided(n, D, H, d, o, density):
    edges = pattern_edges("strided", n, H, stride=o["stride"], causal=bool(o["causal"]))
    return _edge_costs(edges, n, d)


def _sparse_fixed(n, D, H, d, o, density):
    edges = pattern_edges(
        "fixed",
        n,
        H,
        stride=o["stride"],
        c=o["c"],
        causal=bool(o["causal"]),
        distinct_summaries=bool(o["distinct_summaries"]),
    )
    return _edge_costs(edges, n, d)


def _sbm(n, D, H, d, o, density):
    k = int(o["num_clusters"])
    rho = 1.0 if density is None else float(density)
    e = rho * n * n
    per_edge = math.log2(max(k * k, 2)) + 2.0 * math.log2(max(n, 2)) + 2.0 * k + 2.0
    costs = {
        "memberships_mlp": H * 2 * (2 * 2.0 * n * d * d + 3.0 * n * d),
        "memberships": H * 2 * (2.0 * n * k * d + n * k),
        "block_matrix": H * (2.0 * k * k * d + SOFTMAX * k * k),
        "expected_edges": H * (2.0 * n * k * k + 2.0 * n * k + 2.0 * k * k),
        "edge_sampling": H * e * per_edge,
        "ste": H * e,
    }
    costs.update(_edge_costs([e] * H, n, d))
    return costs


def _tsa(n, D, H, d, o, density):
    return {
        "scores": H * 2.0 * n * n * d,
        "graph": H * 4.0 * n * n,
        "filter": H * (2.0 * n * n * d + n * d),
    }


_FLOPS = {
    "full": _full,
    "linear": _linear,
    "performer": _performer,
    "linformer": _linformer,
    "nystromformer": _nystromformer,
    "reformer": _reformer,
    "local": _local,
    "sparse_strided": _sparse_strided,
    "sparse_fixed": _sparse_fixed,
    "sbm": _sbm,
    "tsa": _tsa,
}


def counted_mechanisms() -> list[str]:
    """Mechanisms with a FLOP formula (every registered one, at the time of writing)."""
    return sorted(_FLOPS)


def _projection_flops(
    name: str, n: int, D: int, H: int, d: int, o: Mapping[str, Any]
) -> dict[str, float]:
    if name == "tsa":
        if o["projection"] == "dense":
            qkv = 2 * 2.0 * n * D * H * d
            out = 2.0 * n * H * d * D
        else:
            rank = int(o["tt_rank"])
            qkv = 2 * H * n * _tt_row_flops(D, d, rank)
            out = n * _tt_row_flops(H * d, D, rank)
        return {"qkv_projection": qkv, "out_projection": out}
    count = 2 if name == "reformer" else 3
    return {
        "qkv_projection": count * 2.0 * n * D * H * d,
        "out_projection": 2.0 * n * H * d * D,
    }


def attention_flops(
    name: str,
    *,
    seq_len: int,
    emb_dim: int,
    num_heads: int,
    head_dim: int,
    options: Mapping[str, Any] | None = None,
    density: float | None = None,
) -> dict[str, float]:
    """Analytic FLOPs of one attention layer on one example, per operation plus ``total``.

    Args:
      name: registry name of the mechanism.
      seq_len, emb_dim, num_heads, head_dim: n, D, H, d.
      options: the mechanism's options (its defaults fill the rest).
      density: SBM's fraction of the n^2 pairs sampled (None: 1.0, the dense bound);
        ignored by the other mechanisms.

    Returns:
      ``{op: flops}`` for the ops in the module docstring's table, with the projections
      (``qkv_projection``, ``out_projection``) and ``total`` (their sum).
    """
    _check_shape(seq_len, emb_dim, num_heads, head_dim)
    if name not in _FLOPS:
        get_attention(name, field="mechanism")  # unknown names: the registry's message
        raise ValueError(
            f"mechanism={name!r} is registered but has no FLOP formula; "
            f"counted: {counted_mechanisms()}"
        )
    if density is not None and not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density={density!r} must lie in [0, 1]")
    o = _options(name, options)
    n, D, H, d = seq_len, emb_dim, num_heads, head_dim
    costs = _projection_flops(name, n, D, H, d, o)
    costs.update(_FLOPS[name](n, D, H, d, o, density))
    costs = {k: float(v) for k, v in costs.items()}
    costs["total"] = float(sum(costs.values()))
    return costs


LRA_SEQ_LENS = (1024, 2048, 4096)


def flops_table(
    mechanisms: Iterable[str] | None = None,
    seq_lens: Iterable[int] = LRA_SEQ_LENS,
    *,
    emb_dim: int = 64,
    num_heads: int = 2,
    head_dim: int = 32,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    densities: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Rows ``{mechanism, seq_len, params, flops, attention_flops, relative_to_full}``.

    Defaults are the LRA shapes of the paper's Table 3 (emb 64, 2 heads of 32).
    ``options`` and ``densities`` are keyed by mechanism; ``attention_flops`` leaves out
    the Q/K/V and output projections; ``relative_to_full`` is total / full's total.
    Linformer's ``max_len`` defaults to the row's length (its E, F are [n, proj_len]).
    """
    names = list(mechanisms) if mechanisms is not None else available()
    options = dict(options or {})
    densities = dict(densities or {})
    rows = []
    for n in seq_lens:
        full_total = attention_flops(
            "full", seq_len=n, emb_dim=emb_dim, num_heads=num_heads, head_dim=head_dim
        )["total"]
        for name in names:
            opts = dict(options.get(name, {}))
            if name == "linformer" and "max_len" not in opts:
                opts["max_len"] = n  # projections sized to the sequence, as a task sets them
            shape = dict(emb_dim=emb_dim, num_heads=num_heads, head_dim=head_dim)
            costs = attention_flops(
                name, seq_len=n, options=opts, density=densities.get(name), **shape
            )
            projections = costs["qkv_projection"] + costs["out_projection"]
            rows.append(
                {
                    "mechanism": name,
                    "seq_len": n,
                    "params": attention_param_count(name, seq_len=n, options=opts, **shape),
                    "flops": costs["total"],
                    "attention_flops": costs["total"] - projections,
                    "relative_to_full": costs["total"] / full_total,
                    "density": densities.get(name),
                }
            )
    return rows
