"""Tensorized Spectral Attention (Xu, Konstantinidis, Li, Mandic 2021), registered as "tsa".

Per head h (paper secs. 3-4):

    K = X W_k,  V = X W_v                          (TT/MPO projections, eq. 4)
    Theta[l1, l2] = relu(k_l1 . k_l2 / sqrt(d)),   Theta[l, l] = 0
    Omega = (A + A^T) / 2,  A[l1, l2] = c^(l2 - l1) for l2 > l1, else 0
          i.e. Omega[l1, l2] = c^|l1 - l2| / 2 off the diagonal, 0 on it
    Psi = Omega (.) Theta
    Y = (I + Psi) V                                (first-order spectral graph filter)

The H head outputs are concatenated and combined by an output projection (TT or dense)
into ``out_dim``. There are no queries: Theta is symmetric, so Psi is an undirected graph.
Padding: Psi's rows and columns of padded tokens are zeroed, so a real token's output is
its own value plus Psi-weighted values of real tokens only; padded positions' filtered
outputs are zeroed before the output projection. Design choices where the paper is silent
are listed in docs/tsa.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import (
    HEADS,
    attention_call,
    check_fields,
    check_int,
    head_dense,
    named,
)
from sbm_jax.attention.counting import projection_flops
from sbm_jax.attention.registry import STATS_COLLECTION, register
from sbm_jax.layers.tt import (
    TTDense,
    tt_core_shapes,
    tt_core_stddev,
    tt_modes,
    tt_normal_init,
    tt_num_params,
    tt_ranks,
)

Array = jax.Array

PROJECTIONS = ("tt", "dense")


def time_graph(length: int, damping: float, dtype: Any = jnp.float32) -> Array:
    """Bi-directional time-graph adjacency Omega [length, length] (paper sec. 2.4).

    ``Omega = (A + A^T) / 2`` with ``A[l1, l2] = damping^(l2 - l1)`` for ``l2 > l1`` and 0
    otherwise: ``damping^|l1 - l2| / 2`` off the diagonal, 0 on it.
    """
    pos = jnp.arange(length)
    dist = jnp.abs(pos[:, None] - pos[None, :])
    omega = 0.5 * jnp.power(jnp.asarray(damping, jnp.float32), dist.astype(jnp.float32))
    return jnp.where(dist > 0, omega, 0.0).astype(dtype)


def spectral_adjacency(k: Array, mask: Array, damping: float) -> Array:
    """Time-domain attention graph Psi = Omega (.) relu(K K^T / sqrt(d)), diagonal zeroed.

    k: [batch, length, heads, d]; mask: [batch, length] bool -> Psi [batch, heads, L, L],
    with the rows and columns of padded tokens zeroed.
    """
    length, d = k.shape[1], k.shape[-1]
    scores = jnp.einsum("blhd,bmhd->bhlm", k, k) / jnp.sqrt(jnp.asarray(d, k.dtype))
    theta = jax.nn.relu(scores)
    omega = time_graph(length, damping, k.dtype)  # zero diagonal: Theta[l, l] never used
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    return jnp.where(pair, omega * theta, jnp.zeros((), k.dtype))


def spectral_filter(psi: Array, v: Array, mask: Array) -> Array:
    """Y = (I + Psi) V per head; padded positions' outputs are zeroed.

    psi: [batch, heads, L, L]; v: [batch, L, heads, d]; mask: [batch, L] -> [batch, L, heads, d].
    """
    y = v + jnp.einsum("bhlm,bmhd->blhd", psi, v)
    return jnp.where(mask[:, :, None, None], y, jnp.zeros((), y.dtype))


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


def _tt_params(in_dim: int, out_dim: int, rank: int) -> int:
    """Cores of a TTDense ``in_dim -> out_dim`` with automatic modes (no bias)."""
    in_modes, out_modes = tt_modes(in_dim, out_dim)
    return tt_num_params(in_modes, out_modes, tt_ranks(len(in_modes), rank))


def tsa_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Key/value projections TT (``2 sum_n R_{n-1} I_n J_n R_n prod_{k<n} J_k prod_{k>n} I_k``
    per row, per head) or dense ``2nDd`` per head; per head ``scores 2n^2 d``, ``graph
    4n^2`` (scale, relu, x Omega, mask), ``filter 2n^2 d + nd`` ((I + Psi) V); output
    projection TT or ``2nHdD``."""
    if options["projection"] == "dense":
        projections = projection_flops(n, D, H, d, inputs=2)
    else:
        rank = int(options["tt_rank"])
        projections = {
            "qkv_projection": 2 * H * n * _tt_row_flops(D, d, rank),
            "out_projection": n * _tt_row_flops(H * d, D, rank),
        }
    return {
        **projections,
        "scores": H * 2.0 * n * n * d,
        "graph": H * 4.0 * n * n,
        "filter": H * (2.0 * n * n * d + n * d),
    }


def tsa_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Key and value projections (per head), output projection; biases with ``use_bias``."""
    bias = bool(options["use_bias"])
    if options["projection"] == "dense":
        return 2 * (D * H * d + bias * H * d) + H * d * D + bias * D
    rank = int(options["tt_rank"])
    return 2 * H * (_tt_params(D, d, rank) + bias * d) + _tt_params(H * d, D, rank) + bias * D


@register("tsa", flops=tsa_flops, params=tsa_params)
class TensorizedSpectralAttention(nn.Module):
    """Multi-head Tensorized Spectral Attention: x [B, L, D], mask [B, L] -> [B, L, out_dim].

    Options (``model.attention_options``):
      damping: c in Omega = c^|l1 - l2| / 2, 0 < c < 1 (paper: "strictly less than 1";
        0.9 is the default of the authors' RGTN code, the paper states no value).
      projection: "tt" (MPO layers, the paper) or "dense" (plain nn.Dense baseline).
      tt_rank: inner TT-rank of every projection (2 = the paper's QTT setting).
      use_bias: biases on the key/value/output projections.
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    damping: float = 0.9
    projection: str = "tt"
    tt_rank: int = 2
    use_bias: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the bad option; runs before anything is traced (the
        config check calls it too)."""
        check_fields(self)  # num_heads, head_dim, out_dim, attention_dropout
        check_int("model.attention_options.tt_rank", self.tt_rank)
        if not 0.0 < float(self.damping) < 1.0:
            raise ValueError(
                f"model.attention_options.damping={self.damping!r} must lie in (0, 1) "
                "(the paper's damping constant is strictly less than 1)"
            )
        if self.projection not in PROJECTIONS:
            raise ValueError(
                f"model.attention_options.projection={self.projection!r} must be one of "
                f"{PROJECTIONS}"
            )

    def _head_projection(self, name: str, in_dim: int) -> nn.Module:
        """x [B, L, in_dim] -> [B, L, heads, head_dim], independent weights per head.

        The per-head parameters carry logical axis names with ``heads`` on the head
        axis: the dense kernel ``[D, H, hd]``, and each TT core ``[H, R, I, J, R']`` and
        bias ``[H, hd]`` (``vmap`` adds the leading head axis and its name)."""
        if self.projection == "dense":
            return head_dense(
                self.num_heads, self.head_dim, self.dtype, name, use_bias=self.use_bias
            )
        in_modes, _, ranks = TTDense(self.head_dim, self.tt_rank, parent=None).shapes(in_dim)
        per_head = nn.vmap(
            TTDense,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            out_axes=-2,
            axis_size=self.num_heads,
            metadata_params={nn.PARTITION_NAME: HEADS},
        )
        return per_head(
            features=self.head_dim,
            rank=self.tt_rank,
            use_bias=self.use_bias,
            dtype=self.dtype,
            # TTDense's own defaults, with logical axis names
            core_init=named(
                tt_normal_init(tt_core_stddev(in_modes, ranks)),
                "tt_rank_in",
                "tt_in",
                "tt_out",
                "tt_rank_out",
            ),
            bias_init=named(nn.initializers.zeros_init(), "kv"),
            name=name,
        )

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
        """x: [batch, length, dim]; mask: [batch, length] bool -> [batch, length, out_dim]."""
        self.validate()
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        mask = mask.astype(bool)
        x = x.astype(self.dtype)

        # Projections run in self.dtype; the graph and filter in at least float32 (the
        # filter sums up to L terms per output).
        work = jnp.promote_types(self.dtype, jnp.float32)
        k = self._head_projection("key", x.shape[-1])(x).astype(work)  # [B, L, H, Dh]
        v = self._head_projection("value", x.shape[-1])(x).astype(work)  # [B, L, H, Dh]
        psi = spectral_adjacency(k, mask, self.damping)  # [B, H, L, L]

        pair = mask[:, None, :, None] & mask[:, None, None, :]
        offdiag = ~jnp.eye(x.shape[1], dtype=bool)
        edges = jnp.sum((psi > 0) & pair & offdiag, axis=(-2, -1)).astype(jnp.float32)
        n_real = jnp.sum(mask, axis=-1).astype(jnp.float32)[:, None]  # [B, 1]
        possible = jnp.maximum(n_real * (n_real - 1.0), 1.0)
        self.sow(STATS_COLLECTION, "density", jax.lax.stop_gradient(edges / possible))
        self.sow(STATS_COLLECTION, "edges", jax.lax.stop_gradient(edges))

        if self.attention_dropout > 0.0:
            psi = nn.Dropout(rate=self.attention_dropout)(psi, deterministic=deterministic)

        y = spectral_filter(psi, v, mask).astype(self.dtype)  # [B, L, H, Dh]
        y = y.reshape(*y.shape[:2], self.num_heads * self.head_dim)
        out: nn.Module
        if self.projection == "dense":
            out = nn.Dense(self.out_dim, use_bias=self.use_bias, dtype=self.dtype, name="out")
        else:
            out = TTDense(
                self.out_dim,
                rank=self.tt_rank,
                use_bias=self.use_bias,
                dtype=self.dtype,
                name="out",
            )
        return out(y)
