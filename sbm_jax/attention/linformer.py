"""Linformer attention (Wang et al., 2020), O(n k d) for projection length k.

Keys and values are projected along the sequence with learned matrices
``E, F [max_len, proj_len]`` (one pair per layer, shared by the heads; a sequence of
length n uses their first n rows):

    K' = E[:n]^T K,   V' = F[:n]^T V,   out = softmax(Q K'^T / sqrt(d)) V'.

Padding: padded keys and values are zeroed before the projection, so they never
reach K' or V'. ``attention_dropout`` is applied to the n x k attention weights.
``E`` and ``F`` start as N(0, 1/proj_len) entries, the paper's random-projection
scaling (the LRA reference code uses N(0, 0.02^2) and one matrix for K and V; set
``share_kv=True`` for the latter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import (
    attention_call,
    check_int,
    compute_dtype,
    dropout_weights,
    named,
    project_out,
    project_qkv,
)
from sbm_jax.attention.counting import SOFTMAX, projection_flops, projection_params
from sbm_jax.attention.registry import register

Array = jax.Array


def linformer_scores(q: Array, k: Array, mask: Array, proj_k: Array) -> Array:
    """Attention weights of queries over projected keys.

    Args:
      q, k: [batch, length, heads, d].
      mask: bool [batch, length], True for real tokens.
      proj_k: E [length, proj_len] (already cut to the sequence length).

    Returns:
      softmax weights [batch, heads, length, proj_len].
    """
    d = q.shape[-1]
    k = jnp.where(mask[:, :, None, None], k, 0.0)
    k_proj = jnp.einsum("bnhd,nk->bkhd", k, proj_k.astype(k.dtype))
    logits = jnp.einsum("bnhd,bkhd->bhnk", q, k_proj) / jnp.sqrt(jnp.asarray(d, q.dtype))
    return jax.nn.softmax(logits, axis=-1)


def linformer_values(v: Array, mask: Array, proj_v: Array) -> Array:
    """Projected values F^T V: v [batch, length, heads, dv] -> [batch, proj_len, heads, dv]."""
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    return jnp.einsum("bnhd,nk->bkhd", v, proj_v.astype(v.dtype))


def linformer_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head, k = ``proj_len``: ``sequence_projection 2 * 2nkd`` (E^T K,
    F^T V), ``scale nd``, ``scores 2nkd``, ``softmax 5nk``, ``aggregation 2nkd``."""
    k = int(options["proj_len"])
    return {
        **projection_flops(n, D, H, d),
        "sequence_projection": H * 2 * 2.0 * n * k * d,
        "scale": H * n * d,
        "scores": H * 2.0 * n * k * d,
        "softmax": H * SOFTMAX * n * k,
        "aggregation": H * 2.0 * n * k * d,
    }


def linformer_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections, plus E and F (one with ``share_kv``) ``[max_len, k]``."""
    sequence = int(options["max_len"]) * int(options["proj_len"])
    return projection_params(D, H, d) + sequence * (1 if options["share_kv"] else 2)


def linformer_length(n: int) -> dict[str, Any]:
    """E and F cover the task's padded length: ``max_len = n``."""
    return {"max_len": n}


@register(
    "linformer", flops=linformer_flops, params=linformer_params, length_options=linformer_length
)
class LinformerAttention(nn.Module):
    """Linformer attention with sequence-length projections E, F [max_len, proj_len].

    Options: ``proj_len`` (k, default 256 as in the paper), ``max_len`` (longest input
    the projections cover), ``share_kv`` (one matrix for keys and values).
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    proj_len: int = 256
    max_len: int = 4096
    share_kv: bool = False

    def validate(self, seq_len: int | None = None) -> None:
        """Raise ValueError naming the bad option (the config check calls it too, with
        the longest sequence the model takes as ``seq_len``): ``proj_len`` and
        ``max_len`` ints >= 1, and ``max_len`` covering ``seq_len`` when given."""
        check_int("model.attention_options.proj_len", self.proj_len)
        check_int("model.attention_options.max_len", self.max_len)
        if seq_len is not None and seq_len > self.max_len:
            raise ValueError(
                f"model.attention_options.max_len={self.max_len} is shorter than the input "
                f"length {seq_len} the linformer projections must cover; raise max_len"
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
        """x [B, n, dim], mask [B, n] (True = real) -> [B, n, out_dim]."""
        x, mask = attention_call(self, inputs_q, inputs_k, inputs_v, mask)
        length = x.shape[1]
        self.validate(length)
        # shared by all heads: no head axis (replicated on a heads mesh)
        init = named(nn.initializers.normal(stddev=self.proj_len**-0.5), "length", "proj")
        shape = (self.max_len, self.proj_len)
        proj_k = self.param("proj_k", init, shape)
        proj_v = proj_k if self.share_kv else self.param("proj_v", init, shape)
        q, k, v = project_qkv(x, self.num_heads, self.head_dim, self.dtype)
        ct = compute_dtype(self.dtype)
        weights = linformer_scores(q.astype(ct), k.astype(ct), mask, proj_k[:length])
        weights = dropout_weights(self, weights, self.attention_dropout, deterministic)
        v_proj = linformer_values(v.astype(ct), mask, proj_v[:length])
        out = jnp.einsum("bhnk,bkhd->bnhd", weights, v_proj)
        return project_out(out, self.out_dim, self.dtype)
