"""Sparse Transformer factorized attention patterns, strided and fixed.

From Child, Gray, Radford and Sutskever (2019), "Generating Long Sequences with Sparse
Transformers" (arXiv:1904.10509), its two-dimensional factorized attention, with stride
``l`` and summary width ``c``, for query i and key j, 0-based:

* strided, head type A: ``max(0, i - l) <= j <= i`` (the previous l positions and i);
  bidirectional: ``|i - j| <= l``.
* strided, head type B: ``(i - j) mod l == 0`` (every l-th position); causal adds j <= i.
* fixed, head type A: ``floor(j / l) == floor(i / l)`` (same block); causal adds j <= i.
* fixed, head type B: ``j mod l in {l - c, ..., l - 1}`` (the last c cells of every
  block, the block "summaries"); causal adds j <= i.

Encoders use the bidirectional forms by default (``causal=False``). Heads split across
the two types as in the paper: with H > 1 heads the first ``ceil(H/2)`` use A and the
rest B; with one head, the head attends to the union of A and B. Padding is removed
from the keys on top of the pattern, and a query whose pattern leaves it no real key
outputs zero.

Two implementations with the same parameters, outputs, gradients and stats
(option ``impl``): ``"blocked"`` (default, ``sparse_blocked.py``) computes only the
pattern's pairs, O(n sqrt n) for ``l ~ sqrt(n)`` and a fixed ``c``, with no n x n array;
``"mask"`` applies the pattern as a dense [H, n, n] boolean mask through ``masked.py``
(O(n^2), the reference the blocked form is tested against). The mask helpers below
build the patterns in the graph from iotas, so no n x n constant is embedded in the
compiled program.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sbm_jax.attention._projections import attention_call, check_int, head_dense, out_dense
from sbm_jax.attention.counting import edge_flops, projection_flops, projection_params
from sbm_jax.attention.masked import key_padding_mask, mask_density, masked_attention
from sbm_jax.attention.registry import STATS_COLLECTION, register
from sbm_jax.attention.sparse_blocked import blocked_pattern_attention

Array = jax.Array


def default_stride(n: int) -> int:
    """The stride l close to sqrt(n): ``max(1, round(sqrt(n)))``."""
    return max(1, round(math.sqrt(n)))


MAX_DEFAULT_SUMMARY_CELLS = 8


def default_summary_cells(stride: int) -> int:
    """Default ``c`` of ``sparse_fixed`` for stride ``l``: ``max(1, min(8, l // 8))``.

    Constant (8, the paper's example with l = 128) once l >= 64, so the B head's keys per
    query, ``c n / l``, grow as sqrt(n) like the rest of the pattern; a c growing with l
    (e.g. l // 8) would give every query n / 8 keys, quadratic in n. Short strides get
    l // 8 so the summary never fills the block.
    """
    return max(1, min(MAX_DEFAULT_SUMMARY_CELLS, stride // 8))


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


def _check_stride(n: int, stride: int) -> None:
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {n}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")


def _positions(n: int) -> tuple[Array, Array]:
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return i, j


def strided_pattern(n: int, stride: int, causal: bool = False) -> Array:
    """Strided pattern for length ``n`` -> bool [2, n, n]: [A (local), B (every l-th)]."""
    _check_stride(n, stride)
    i, j = _positions(n)
    diff = i - j
    if causal:
        a = (diff >= 0) & (diff <= stride)
        b = (diff >= 0) & (diff % stride == 0)
    else:
        a = jnp.abs(diff) <= stride
        b = diff % stride == 0
    return jnp.stack([a, b])


def fixed_pattern(
    n: int, stride: int, c: int, causal: bool = False, summary_offset: int = 0
) -> Array:
    """Fixed pattern for length ``n`` -> bool [2, n, n]: [A (same block), B (summaries)].

    ``summary_offset`` shifts the summary cells of B towards the block start:
    ``j mod l in {l - c - o, ..., l - 1 - o}`` (mod l), so that several B heads can use
    distinct subblocks, as the paper found preferable.
    """
    _check_stride(n, stride)
    if not 1 <= c <= stride:
        raise ValueError(f"c must be in [1, stride={stride}], got {c}")
    i, j = _positions(n)
    a = (i // stride) == (j // stride)
    b = (stride - 1 - summary_offset - j % stride) % stride < c
    if causal:
        a = a & (j <= i)
        b = b & (j <= i)
    return jnp.stack([a, b])


def split_heads(a_patterns: Array, b_patterns: Array, num_heads: int) -> Array:
    """Per-head masks [H, n, n] from type-A and type-B patterns.

    ``a_patterns`` / ``b_patterns``: [n, n] or [k, n, n] (head h of a type takes entry
    ``h mod k``). One head gets A | B (first entries); otherwise the first
    ``ceil(H/2)`` heads get A and the remaining ``floor(H/2)`` get B.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    a_patterns = a_patterns[None] if a_patterns.ndim == 2 else a_patterns
    b_patterns = b_patterns[None] if b_patterns.ndim == 2 else b_patterns
    if num_heads == 1:
        return (a_patterns[0] | b_patterns[0])[None]
    num_a = num_heads - num_heads // 2
    heads = [a_patterns[h % a_patterns.shape[0]] for h in range(num_a)]
    heads += [b_patterns[h % b_patterns.shape[0]] for h in range(num_heads - num_a)]
    return jnp.stack(heads)


IMPLS = ("blocked", "mask")


class _PatternAttention(nn.Module):
    """Multi-head attention whose heads follow a Sparse Transformer pattern (subclasses).

    ``impl="blocked"`` (default) runs ``sparse_blocked.blocked_pattern_attention`` in
    O(n sqrt n); ``impl="mask"`` applies ``head_patterns(n)`` as a dense [H, n, n] mask
    through ``masked_attention`` (O(n^2), the reference). Both give the same outputs,
    gradients and stats and use the same parameters.
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    stride: int | None = None
    causal: bool = False
    impl: str = "blocked"

    def __post_init__(self) -> None:
        # Options known at construction fail here, before anything is traced.
        self.validate()
        super().__post_init__()

    def validate(self, seq_len: int | None = None) -> None:
        """Raise ValueError naming the bad option (the config check calls it too, with
        the longest sequence the model takes as ``seq_len``): ``stride`` None or an int
        >= 1, ``impl`` one of IMPLS."""
        if self.stride is not None:
            check_int("model.attention_options.stride", self.stride)
        if self.impl not in IMPLS:
            raise ValueError(f"model.attention_options.impl={self.impl!r} must be one of {IMPLS}")

    def resolved_stride(self, n: int) -> int:
        """The stride l for input length n (``stride`` or ``round(sqrt(n))``)."""
        stride = default_stride(n) if self.stride is None else self.stride
        if stride < 1:
            raise ValueError(f"model.attention_options.stride must be >= 1, got {stride}")
        return stride

    def blocked_options(self, n: int) -> dict[str, Any]:
        """Keyword options of ``blocked_pattern_attention`` for input length n."""
        raise NotImplementedError(f"{type(self).__name__} must define blocked_options")

    def head_patterns(self, n: int) -> Array:
        """bool [H, n, n]: which keys each head's queries may attend to."""
        raise NotImplementedError(f"{type(self).__name__} must define head_patterns")

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_k: Array | None = None,
        inputs_v: Array | None = None,
        *,
        mask: Array | None = None,
        deterministic: bool,
    ) -> Array:
        """x [B, n, dim], mask [B, n] (True = real) -> [B, n, out_dim]."""
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        n = x.shape[1]
        self.validate(n)
        options = self.blocked_options(n)  # validates the options before any tracing
        q = head_dense(self.num_heads, self.head_dim, self.dtype, "query")(x)
        k = head_dense(self.num_heads, self.head_dim, self.dtype, "key")(x)
        v = head_dense(self.num_heads, self.head_dim, self.dtype, "value")(x)
        rng = None
        if not deterministic and self.attention_dropout > 0.0:
            rng = self.make_rng("dropout")
        dropout: dict[str, Any] = dict(
            dropout_rate=self.attention_dropout, dropout_rng=rng, deterministic=deterministic
        )
        if self.impl == "mask":
            allowed = self.head_patterns(n)[None] & key_padding_mask(mask)  # [B, H, n, n]
            density, edges = mask_density(allowed, mask)
            out = masked_attention(q, k, v, allowed, **dropout)
        else:
            out, edges = blocked_pattern_attention(q, k, v, mask, **options, **dropout)
            real = jnp.sum(mask, axis=-1, dtype=jnp.float32)
            density = edges / jnp.maximum(real * real, 1.0)[:, None]
        self.sow(STATS_COLLECTION, "density", density)
        self.sow(STATS_COLLECTION, "edges", edges)
        return out_dense(self.out_dim, self.dtype)(out)


def sparse_strided_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; softmax attention over E = the head's attended (query, key) pairs
    (:func:`pattern_edges`): ``scale nd``, ``scores 2Ed``, ``softmax 5E``, ``aggregation
    2Ed``. This is the algorithmic cost; ``impl="blocked"`` executes the scores of the
    blocks it gathers (a small multiple of E, e.g. 3l keys per query for the strided band
    that keeps 2l + 1); ``impl="mask"`` full attention's."""
    edges = pattern_edges("strided", n, H, stride=options["stride"], causal=bool(options["causal"]))
    return {**projection_flops(n, D, H, d), **edge_flops(edges, n, d)}


def sparse_fixed_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """As :func:`sparse_strided_flops`, over the fixed pattern's pairs."""
    edges = pattern_edges(
        "fixed",
        n,
        H,
        stride=options["stride"],
        c=options["c"],
        causal=bool(options["causal"]),
        distinct_summaries=bool(options["distinct_summaries"]),
    )
    return {**projection_flops(n, D, H, d), **edge_flops(edges, n, d)}


def pattern_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections with biases (the patterns hold no parameters)."""
    return projection_params(D, H, d)


@register("sparse_strided", flops=sparse_strided_flops, params=pattern_params)
class SparseStridedAttention(_PatternAttention):
    """Sparse Transformer strided attention.

    Options: ``stride`` (l; None = round(sqrt(n)) of the input length), ``causal``,
    ``impl`` ("blocked", default, O(n sqrt n); "mask", the dense-mask reference).
    """

    def blocked_options(self, n: int) -> dict[str, Any]:
        return dict(kind="strided", stride=self.resolved_stride(n), causal=self.causal)

    def head_patterns(self, n: int) -> Array:
        a, b = strided_pattern(n, self.resolved_stride(n), self.causal)
        return split_heads(a, b, self.num_heads)


@register("sparse_fixed", flops=sparse_fixed_flops, params=pattern_params)
class SparseFixedAttention(_PatternAttention):
    """Sparse Transformer fixed attention.

    Options: ``stride`` (l; None = round(sqrt(n))), ``c`` (summary cells per block;
    None = :func:`default_summary_cells`: 8 for every l >= 64, the paper's example of
    l = 128 with c = 8, so the cost stays O(n sqrt n); at most l), ``causal``,
    ``distinct_summaries`` (B heads use distinct subblocks of c cells, the paper's
    preferred multi-head variant), ``impl`` ("blocked", default, O(n sqrt n) for a
    fixed c; "mask", the dense-mask reference).
    """

    c: int | None = None
    distinct_summaries: bool = False

    def validate(self, seq_len: int | None = None) -> None:
        """As the base class, and ``c`` None or an int in [1, l]: l is ``stride``, or
        the default ``round(sqrt(seq_len))`` when ``stride`` is None and ``seq_len``
        (the longest input) is given (a shorter input has a shorter default stride)."""
        super().validate(seq_len)
        if self.c is None:
            return
        check_int("model.attention_options.c", self.c)
        stride = self.stride
        if stride is None and seq_len is not None:
            stride = default_stride(seq_len)
        if stride is not None and self.c > stride:
            where = "" if self.stride is not None else f", the default for length {seq_len}"
            raise ValueError(
                f"model.attention_options.c must be in [1, stride={stride}{where}], got {self.c}"
            )

    def resolved_c(self, stride: int) -> int:
        """Summary cells per block for stride l (``c`` or :func:`default_summary_cells`)."""
        if self.c is None:
            return default_summary_cells(stride)
        if not 1 <= self.c <= stride:
            raise ValueError(
                f"model.attention_options.c must be in [1, stride={stride}], got {self.c}"
            )
        return self.c

    def blocked_options(self, n: int) -> dict[str, Any]:
        stride = self.resolved_stride(n)
        return dict(
            kind="fixed",
            stride=stride,
            c=self.resolved_c(stride),
            causal=self.causal,
            distinct_summaries=self.distinct_summaries,
        )

    def head_patterns(self, n: int) -> Array:
        stride = self.resolved_stride(n)
        c = self.resolved_c(stride)
        num_b = self.num_heads // 2 if self.distinct_summaries else 1
        patterns = [
            fixed_pattern(n, stride, c, self.causal, summary_offset=(h * c) % stride)
            for h in range(max(num_b, 1))
        ]
        a = patterns[0][0]
        b = jnp.stack([p[1] for p in patterns])
        return split_heads(a, b, self.num_heads)
