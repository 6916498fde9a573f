"""Full softmax attention, the reference mechanism every efficient one is compared with.

Registered as ``"full"``. Every query attends to every real key (padded keys are masked
out). Exact softmax attention has several implementations, of very different cost; the
``implementation`` option picks one (the parameters are the same for all, so a
checkpoint loads whichever is chosen):

* ``"xla"``: ``jax.nn.dot_product_attention`` with no ``implementation``, which on every
  backend is XLA's naive attention: it materialises the ``[batch, heads, n, n]`` scores
  (and weights, for the backward pass).
* ``"chunked"``: exact softmax attention over blocks of ``query_chunk`` queries under
  ``lax.map`` (memory-efficient attention, Rabe & Staats 2021), each block rematerialised
  in the backward pass (``jax.checkpoint``): ``O(query_chunk x n)`` scratch per
  (example, head) instead of ``O(n^2)``, on every backend. A length that is not a
  multiple of ``query_chunk`` is padded with zero queries up to one (their rows are
  computed and dropped); a length up to ``query_chunk`` is one block.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's flash
  attention: NVIDIA GPUs only, bfloat16 or float16 compute dtype only. Keys are
  permuted so that the real ones come first and passed as ``key_value_seq_lengths``
  (attention is invariant to the order of the keys), so any padding mask is exact and
  no ``n x n`` bias is formed. It has no attention dropout.
* ``"auto"`` (default): ``"cudnn"`` on a GPU when the compute dtype is bfloat16/float16,
  the head width is one cuDNN takes (a multiple of 8, at most 128) and no attention
  dropout is applied; else ``"chunked"`` when the length exceeds ``query_chunk``; else
  ``"xla"`` (one block: chunking would change nothing but the schedule).

Attention dropout (training only) is applied to the weights by ``"xla"`` (through an
explicit softmax, since ``jax.nn.dot_product_attention`` offers none) and by
``"chunked"`` (each block's mask drawn from the ``dropout`` stream folded with the block
index, so the backward pass regenerates it); ``"cudnn"`` refuses a nonzero rate.

Cross-attention (``inputs_k`` / ``inputs_v`` of another length than ``inputs_q``, with a
key-padding mask over the keys) runs through every implementation: queries are chunked,
keys and values are attended whole.

Statistics follow the registry contract so that plots and logs treat every mechanism
alike: ``density`` is 1 (every real query-key pair is attended) and ``edges`` is the
number of real pairs, both ``[batch, heads]`` (across two sequences every query counts as
real: a key-padding mask says nothing of the queries). The density is a constant, so a
density regulariser adds nothing to full attention's gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import (
    check_int,
    cross_attention_call,
    head_dense,
    out_dense,
)
from sbm_jax.attention.counting import SOFTMAX, projection_flops, projection_params
from sbm_jax.attention.registry import STATS_COLLECTION, register

Array = jax.Array

#: The values of ``FullAttention.implementation``.
IMPLEMENTATIONS = ("auto", "xla", "chunked", "cudnn")
#: Compute dtypes cuDNN's flash attention takes.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
#: Head widths ``"auto"`` sends to cuDNN (its flash kernels' common range).
_CUDNN_MAX_HEAD_DIM = 128


def full_flops(
    n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
) -> dict[str, float]:
    """Projections; per head ``scale nd``, ``scores 2n^2 d``, ``softmax 5n^2``,
    ``aggregation 2n^2 d`` (the same for every implementation: the forward pass)."""
    return {
        **projection_flops(n, D, H, d),
        "scale": H * n * d,
        "scores": H * 2.0 * n * n * d,
        "softmax": H * SOFTMAX * n * n,
        "aggregation": H * 2.0 * n * n * d,
    }


def full_params(n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int:
    """Q, K, V and output projections with biases."""
    return projection_params(D, H, d)


def _is_cudnn_dtype(dtype: Any) -> bool:
    return any(jnp.dtype(dtype) == jnp.dtype(t) for t in CUDNN_DTYPES)


#: Scores per (example, head) a chunked block aims at: ``query_chunk = 2^19 // n``.
#: Measured on a 2-core x86 CPU, fwd+bwd, whole layers (B=2, H=2, d_h=32; n=16384 at
#: B=1), against fixed blocks: the fastest block and among the smallest in memory at every
#: length (docs/benchmarks.md, "The exact baseline").
CHUNK_SCORES = 2**19


def default_query_chunk(length: int) -> int:
    """``query_chunk=0``'s block for ``length`` keys: ``2^19 // length`` queries, in
    ``[16, 512]`` (n=1024: 512, n=4096: 128, n=16384: 32)."""
    return int(min(512, max(16, CHUNK_SCORES // max(int(length), 1))))


def resolve_implementation(
    implementation: str,
    *,
    length: int,
    head_dim: int,
    dtype: Any,
    query_chunk: int,
    dropout: bool,
    backend: str | None = None,
) -> str:
    """The implementation ``"auto"`` stands for (any other value is returned as is).

    ``dropout``: whether attention dropout is applied in this call; ``backend``: the
    platform (default ``jax.default_backend()``).
    """
    if implementation != "auto":
        return implementation
    backend = jax.default_backend() if backend is None else backend
    if (
        backend == "gpu"
        and _is_cudnn_dtype(dtype)
        and head_dim % 8 == 0
        and head_dim <= _CUDNN_MAX_HEAD_DIM
        and not dropout
    ):
        return "cudnn"
    return "chunked" if length > query_chunk else "xla"


def _block_attention(
    q: Array, k: Array, v: Array, key_mask: Array, keep: Array | None, keep_prob: float
) -> Array:
    """Exact softmax attention of queries ``q [B, c, H, d]`` over all keys
    ``k, v [B, m, H, d]`` (``key_mask [B, 1, 1, m]``): scores and softmax in float32,
    weights cast to the values' dtype. ``keep [B, H, c, m]``: dropout's kept weights."""
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = logits * scale  # float32 scores, not bf16 ones cast up
    logits = jnp.where(key_mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if keep is not None:
        weights = jnp.where(keep, weights / keep_prob, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)


def chunked_attention(
    q: Array,
    k: Array,
    v: Array,
    key_mask: Array,
    *,
    query_chunk: int,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
    """Exact softmax attention, ``query_chunk`` queries at a time.

    ``q [B, n, H, d]``, ``k, v [B, m, H, d]`` (``m = n`` when a sequence attends to
    itself), ``key_mask [B, m]`` bool (True: a real key) -> ``[B, n, H, d]``. The blocks
    run one after another under ``lax.map``, each under ``jax.checkpoint``: the backward
    pass recomputes a block's scores instead of storing them, so scratch memory is
    ``O(B H query_chunk m)``. A length that is not a multiple
    of ``query_chunk`` gets zero queries appended up to one (dropped from the output).
    Attention dropout (``dropout_rate > 0`` with ``dropout_rng``): block ``i``'s mask is
    drawn from ``fold_in(dropout_rng, i)``, the same in the forward and backward pass.
    """
    batch, length, heads, dim = q.shape
    keys = k.shape[1]
    chunk = min(int(query_chunk), length)
    blocks = -(-length // chunk)
    padded = blocks * chunk
    if padded != length:
        q = jnp.pad(q, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
    # [blocks, B, chunk, H, d]: lax.map runs over the leading axis.
    q_blocks = q.reshape(batch, blocks, chunk, heads, dim).transpose(1, 0, 2, 3, 4)
    mask4 = key_mask.astype(jnp.bool_)[:, None, None, :]
    use_dropout = dropout_rate > 0.0 and dropout_rng is not None
    keep_prob = 1.0 - dropout_rate

    @jax.checkpoint
    def block(args: tuple[Array, Array]) -> Array:
        index, q_block = args
        keep = None
        if use_dropout:
            rng = jax.random.fold_in(dropout_rng, index)  # type: ignore[arg-type]
            keep = jax.random.bernoulli(rng, keep_prob, (batch, heads, chunk, keys))
        return _block_attention(q_block, k, v, mask4, keep, keep_prob)

    out = jax.lax.map(block, (jnp.arange(blocks), q_blocks))  # [blocks, B, chunk, H, d]
    out = out.transpose(1, 0, 2, 3, 4).reshape(batch, padded, heads, dim)
    return out[:, :length]


def cudnn_attention(q: Array, k: Array, v: Array, key_mask: Array) -> Array:
    """cuDNN flash attention of ``q [B, n, H, d]`` over the real keys of ``k, v
    [B, m, H, d]`` (``key_mask [B, m]``): the keys (and values) are reordered real ones
    first, a stable order, and their count is passed as ``key_value_seq_lengths``, which
    is exact for any mask since attention does not depend on the keys' order."""
    key_mask = key_mask.astype(jnp.bool_)
    order = jnp.argsort(~key_mask, axis=-1, stable=True)  # real keys first
    k = jnp.take_along_axis(k, order[:, :, None, None], axis=1)
    v = jnp.take_along_axis(v, order[:, :, None, None], axis=1)
    # A fully padded example keeps one key, so no row is empty (its output is ignored).
    lengths = jnp.maximum(jnp.sum(key_mask, axis=-1, dtype=jnp.int32), 1)
    return jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"
    )


@register("full", flops=full_flops, params=full_params)
class FullAttention(nn.Module):
    """Multi-head softmax attention over all real tokens.

    Attributes:
      num_heads: number of heads H.
      head_dim: per-head width d_h of queries, keys and values.
      out_dim: width of the output (the model width).
      attention_dropout: dropout rate on the attention weights (training only).
      dtype: compute dtype; parameters stay float32.
      implementation: ``"auto"``, ``"xla"``, ``"chunked"`` or ``"cudnn"`` (module
        docstring); the same parameters for all.
      query_chunk: queries per block of ``"chunked"`` (and the length above which
        ``"auto"`` chunks); lengths that are not a multiple are padded up to one. 0
        (default): :func:`default_query_chunk` of the number of keys.
    """

    num_heads: int
    head_dim: int
    out_dim: int
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    implementation: str = "auto"
    query_chunk: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the bad option (the config check calls it too),
        before anything is traced."""
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"model.attention_options.implementation must be one of {IMPLEMENTATIONS}, "
                f"got {self.implementation!r}"
            )
        check_int("model.attention_options.query_chunk", self.query_chunk, minimum=0)
        if self.implementation != "cudnn":
            return
        backend = jax.default_backend()
        if backend != "gpu":
            raise ValueError(
                "model.attention_options.implementation='cudnn' needs an NVIDIA GPU, but "
                f"the backend is {backend!r}; use 'chunked' (exact, memory-efficient) or 'auto'"
            )
        if not _is_cudnn_dtype(self.dtype):
            raise ValueError(
                "model.attention_options.implementation='cudnn' takes only a bfloat16 or "
                f"float16 compute dtype (model.dtype), got {jnp.dtype(self.dtype).name}; "
                "use model.dtype='bfloat16' or implementation 'chunked'"
            )
        if self.attention_dropout:
            raise ValueError(
                "model.attention_options.implementation='cudnn' has no attention dropout, "
                f"but model.attention_dropout={self.attention_dropout}; use 'chunked' or 'auto'"
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
        """x [batch, length, dim], mask [batch, length] bool -> [batch, length, out_dim];
        or cross-attention: inputs_q [batch, q, dim], inputs_k / inputs_v [batch, k, dim],
        a key mask -> [batch, q, out_dim] (``cross_attention_call``)."""
        x, x_k, x_v, mask, query_mask = cross_attention_call(
            self, inputs_q, inputs_k, inputs_v, mask
        )
        self.validate()
        batch, length, _ = x.shape
        keys = x_k.shape[1]

        def project(name: str, inputs: Array) -> Array:
            dense = head_dense(self.num_heads, self.head_dim, self.dtype, name)
            return dense(inputs)  # [batch, length, heads, head_dim]

        q, k, v = project("query", x), project("key", x_k), project("value", x_v)
        dropout = not deterministic and self.attention_dropout > 0.0
        chunk = self.query_chunk or default_query_chunk(keys)
        impl = resolve_implementation(
            self.implementation,
            length=length,
            head_dim=self.head_dim,
            dtype=self.dtype,
            query_chunk=chunk,
            dropout=dropout,
        )
        # Only keys are masked: padded queries still see real keys (their outputs are
        # ignored downstream), so no row is empty and nothing turns NaN.
        key_mask = mask[:, None, None, :]  # [batch, 1, 1, keys]
        if impl == "cudnn":
            out = cudnn_attention(q, k, v, mask)
        elif impl == "chunked":
            out = chunked_attention(
                q,
                k,
                v,
                mask,
                query_chunk=chunk,
                dropout_rate=self.attention_dropout if dropout else 0.0,
                dropout_rng=self.make_rng("dropout") if dropout else None,
            )
        elif not dropout:
            out = jax.nn.dot_product_attention(q, k, v, mask=key_mask)
        else:
            keep_prob = 1.0 - self.attention_dropout
            shape = (batch, self.num_heads, length, keys)
            keep = jax.random.bernoulli(self.make_rng("dropout"), keep_prob, shape)
            out = _block_attention(q, k, v, key_mask, keep, keep_prob)
        chex.assert_shape(out, (batch, length, self.num_heads, self.head_dim))

        real_keys = jnp.sum(mask, axis=-1, dtype=jnp.float32)  # [batch]
        real_queries = jnp.sum(query_mask, axis=-1, dtype=jnp.float32)
        pairs = real_queries * real_keys
        edges = jnp.broadcast_to(pairs[:, None], (batch, self.num_heads))
        density = jnp.where(edges > 0, 1.0, 0.0)
        self.sow(STATS_COLLECTION, "density", density)
        self.sow(STATS_COLLECTION, "edges", edges)

        out = out_dense(self.out_dim, self.dtype)(out)
        return out  # [batch, length, out_dim]
