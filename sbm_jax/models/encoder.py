"""Transformer encoder whose attention mechanism comes from the registry.

``Encoder``: token + learned position embeddings, ``num_layers`` pre-LN blocks
(LN -> attention -> dropout -> residual, LN -> MLP(GELU) -> dropout -> residual), and a
final LN. With ``pooling="cls"`` a learned CLS vector is prepended (position 0) and its
output is the sequence representation; with ``"mean"`` the real tokens' outputs are
averaged. Padded positions never influence real positions: attention masks them (by the
registry contract) and every other layer acts per token.

Two training aids of the Sparse Transformer (Child et al. 2019, sec. 5.2-5.3), usable
with every registered mechanism:

* ``remat=True``: each block runs under ``nn.remat``, so its activations (attention
  weights included) are recomputed in the backward pass instead of stored. Parameters,
  loss and gradients are unchanged; memory falls, compute rises by about one forward.
  The recomputation is tied to the cotangent (``call_recomputed_after_cotangent``), so
  XLA:CPU, which drops ``nn.remat``'s barrier, cannot hoist it into the forward pass.
* ``scaled_residual_init=True``: the two projections that write into the residual
  stream, the attention's output projection (the submodule named ``out`` that every
  mechanism has) and the MLP's second layer ``fc2``, start scaled by
  ``1 / sqrt(2 * num_layers)``. For a dense ``out`` the kernel is scaled; for a
  tensor-train ``out`` (TSA) the first core is, which scales the rebuilt matrix by the
  same factor. Biases (zero at init) and every other parameter are untouched.

One initialisation choice the papers leave open, measured on the synthetic task
(docs/synthetic.md):

* ``query_key_init="tied"``: each block's key projection starts as a copy of its query
  projection (kernel and bias), then both train freely. The bilinear form
  ``W_q^T W_k`` then starts positive semi-definite, so equal inputs already score
  highest at step 0; with independent draws (``"independent"``, the default, as in the
  reference code) it starts with eigenvalues of both signs and a 1-layer model has to
  learn the alignment first. Only mechanisms with same-shaped ``query`` and ``key``
  projections can tie; others raise an error naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax._remat import call_recomputed_after_cotangent
from sbm_jax.attention import build_attention

Array = jax.Array

POOLING_MODES = ("mean", "cls", "none")
QUERY_KEY_INITS = ("independent", "tied")
POSITION_EMBEDDINGS = ("learned", "sinusoidal", "none")

# The submodule of every registered mechanism that projects its heads back to the model
# width: the attention's residual output projection.
OUTPUT_PROJECTION = "out"


def scaled_residual_factor(num_layers: int) -> float:
    """The Sparse Transformer's residual-projection init factor ``1 / sqrt(2 * num_layers)``."""
    if num_layers < 1:
        raise ValueError(f"model.num_layers={num_layers!r} must be >= 1")
    return 1.0 / math.sqrt(2.0 * num_layers)


def scale_output_projection(variables: Any, *, scale: float, attention: str) -> Any:
    """Multiply the attention's output projection by ``scale`` in a ``{"params": ...}`` tree.

    A dense projection (``kernel``) has its kernel scaled; a tensor-train projection
    (``core_0``, ``core_1``, ...) has its first core scaled, which scales the matrix the
    cores represent by ``scale``. Biases are left alone.
    """
    params = dict(variables.get("params", {}))
    out = params.get(OUTPUT_PROJECTION)
    if out is None:
        raise ValueError(
            f"model.scaled_residual_init needs attention {attention!r} to name its output "
            f"projection {OUTPUT_PROJECTION!r}; its parameters are {sorted(params)}"
        )
    out = dict(out)

    def scaled(x: Any) -> Any:  # keeps the logical axis names of a boxed parameter
        if isinstance(x, nn.Partitioned):
            return x.replace_boxed(x.value * scale)
        return x * scale

    if "kernel" in out:
        out["kernel"] = scaled(out["kernel"])
    elif "core_0" in out:
        out["core_0"] = scaled(out["core_0"])
    else:
        raise ValueError(
            f"model.scaled_residual_init: the output projection of attention {attention!r} "
            f"has neither a 'kernel' nor TT cores; its parameters are {sorted(out)}"
        )
    params[OUTPUT_PROJECTION] = out
    return {**variables, "params": params}


def tie_query_key(variables: Any, *, attention: str) -> Any:
    """Copy the ``query`` projection over the ``key`` projection in ``{"params": ...}``."""
    params = dict(variables.get("params", {}))
    query, key = params.get("query"), params.get("key")
    if query is None or key is None:
        raise ValueError(
            f"model.query_key_init='tied' needs attention {attention!r} to have 'query' and "
            f"'key' projections; its parameters are {sorted(params)}"
        )
    shapes = jax.tree.map(jnp.shape, (query, key))
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"model.query_key_init='tied': attention {attention!r} has query and key "
            f"projections of different shapes {shapes[0]} and {shapes[1]}"
        )
    params["key"] = jax.tree.map(lambda a: a, query)
    return {**variables, "params": params}


def sinusoidal_positions(length: int, dim: int) -> Array:
    """The Transformer's fixed sine/cosine table [length, dim] (sin and cos interleaved)."""
    if dim % 2:
        raise ValueError(f"model.emb_dim={dim} must be even for sinusoidal positions")
    position = jnp.arange(length, dtype=jnp.float32)[:, None]
    inv = jnp.exp(jnp.arange(0, dim, 2, dtype=jnp.float32) * -(math.log(10000.0) / dim))
    return jnp.stack([jnp.sin(position * inv), jnp.cos(position * inv)], -1).reshape(length, dim)


def masked_mean_pool(x: Array, mask: Array) -> Array:
    """Mean of ``x [batch, length, dim]`` over positions where ``mask [batch, length]``.

    Returns [batch, dim]; a row without real tokens gives zeros.
    """
    chex.assert_rank(x, 3)
    chex.assert_shape(mask, x.shape[:2])
    total = jnp.sum(jnp.where(mask[..., None], x, 0.0), axis=1)  # [batch, dim]
    count = jnp.sum(mask, axis=1, dtype=jnp.float32)[:, None]  # [batch, 1]
    return (total / jnp.maximum(count, 1.0)).astype(x.dtype)


class MlpBlock(nn.Module):
    """Dense(mlp_dim) -> GELU -> dropout -> Dense(out_dim), applied per token.

    ``out_init_scale`` multiplies the LeCun-normal init of the second layer's kernel.
    """

    mlp_dim: int
    out_dim: int
    dropout: float = 0.0
    dtype: Any = jnp.float32
    out_init_scale: float = 1.0

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool) -> Array:
        """x [..., dim] -> [..., out_dim]."""
        h = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1")(x)
        h = nn.gelu(h)
        h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
        init = nn.initializers.variance_scaling(
            self.out_init_scale**2, "fan_in", "truncated_normal"
        )  # scale 1: flax's default lecun_normal
        return nn.Dense(self.out_dim, dtype=self.dtype, kernel_init=init, name="fc2")(h)


class EncoderBlock(nn.Module):
    """One pre-LN transformer block with a registry attention mechanism.

    ``residual_init_scale`` (1.0: off) scales the initial attention output projection
    and MLP second layer; ``query_key_init="tied"`` starts the key projection as a copy
    of the query projection (see the module docstring).
    """

    emb_dim: int
    num_heads: int
    head_dim: int
    mlp_dim: int
    attention: str
    attention_options: Mapping[str, Any] | None = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32
    residual_init_scale: float = 1.0
    query_key_init: str = "independent"

    def _init_transform(self, variables: Any) -> Any:
        """What ``init`` does to the attention's freshly drawn parameters."""
        if self.residual_init_scale != 1.0:
            variables = scale_output_projection(
                variables, scale=self.residual_init_scale, attention=self.attention
            )
        if self.query_key_init == "tied":
            variables = tie_query_key(variables, attention=self.attention)
        return variables

    @nn.compact
    def __call__(self, x: Array, mask: Array, deterministic: bool) -> Array:
        """x [batch, length, emb_dim], mask [batch, length] -> [batch, length, emb_dim].

        ``deterministic`` may be passed by position (``nn.remat`` marks it static).
        """
        chex.assert_shape(x, (None, None, self.emb_dim))
        h = nn.LayerNorm(dtype=self.dtype, name="ln_attention")(x)
        attention = build_attention(
            self.attention,
            options=dict(self.attention_options or {}),
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            out_dim=self.emb_dim,
            attention_dropout=self.attention_dropout,
            dtype=self.dtype,
            parent=None,  # built detached, then adopted under a fixed name
        )
        if self.query_key_init not in QUERY_KEY_INITS:
            raise ValueError(
                f"model.query_key_init={self.query_key_init!r} is not one of {QUERY_KEY_INITS}"
            )
        custom_init = self.residual_init_scale != 1.0 or self.query_key_init != "independent"
        if custom_init and self.is_initializing():
            # Same module and parameter tree; only the freshly created parameters are
            # transformed (output projection scaled, key tied to query). With init=True,
            # map_variables creates the params, then passes them once through
            # trans_in_fn before the run whose params it returns, so the transform sits
            # there (trans_out_fn would run twice: on creation and at the end). Applying
            # the model later uses the plain module: no mapping.
            scaled_cls = nn.map_variables(
                type(attention), "params", trans_in_fn=self._init_transform, init=True
            )
            fields = {
                f.name: getattr(attention, f.name)
                for f in dataclasses.fields(attention)
                if f.init and f.name not in ("parent", "name")
            }
            attention = scaled_cls(**fields, parent=self, name="attention")
        else:
            attention = attention.clone(parent=self, name="attention")
        h = attention(h, mask, deterministic=deterministic)
        chex.assert_equal_shape((h, x))
        h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
        x = x + h
        h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
        h = MlpBlock(
            self.mlp_dim,
            self.emb_dim,
            self.dropout,
            self.dtype,
            out_init_scale=self.residual_init_scale,
            name="mlp",
        )(h, deterministic=deterministic)
        h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
        return x + h


class Encoder(nn.Module):
    """Embeddings, ``num_layers`` pre-LN blocks and a final LayerNorm.

    Attributes:
      vocab_size: number of token ids (id 0 is conventionally padding).
      max_len: longest sequence the position table covers (without the CLS slot).
      emb_dim: model width.
      num_layers: number of blocks.
      num_heads, head_dim: attention heads and per-head width.
      mlp_dim: hidden width of the MLP.
      attention: registry name of the attention mechanism.
      attention_options: that mechanism's own options.
      dropout: dropout after embeddings, attention and MLP.
      attention_dropout: dropout on attention weights.
      pooling: "mean", "cls" or "none"; "cls" prepends a learned CLS vector.
      dtype: compute dtype.
      remat: recompute each block's activations in the backward pass (``nn.remat``).
      scaled_residual_init: scale the initial residual output projections (attention
        ``out`` and MLP ``fc2``) by ``1 / sqrt(2 * num_layers)``.
      query_key_init: "independent" or "tied" (key projection starts as a copy of the
        query projection; see the module docstring).
      position_embedding: "learned" (a table initialised at std 0.02, as the reference
        code), "sinusoidal" (the fixed sine/cosine table) or "none".
      final_norm: apply the final LayerNorm (the reference code does).
    """

    vocab_size: int
    max_len: int
    emb_dim: int
    num_layers: int
    num_heads: int
    head_dim: int
    mlp_dim: int
    attention: str = "full"
    attention_options: Mapping[str, Any] | None = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    pooling: str = "mean"
    dtype: Any = jnp.float32
    remat: bool = False
    scaled_residual_init: bool = False
    query_key_init: str = "independent"
    position_embedding: str = "learned"
    final_norm: bool = True

    @nn.compact
    def __call__(
        self, inputs: Array, mask: Array, *, deterministic: bool
    ) -> tuple[Array, Array, Array | None]:
        """Encode token ids.

        Args:
          inputs: int token ids [batch, length].
          mask: bool [batch, length], True for real tokens.
          deterministic: disables dropout (SBM graph sampling stays on).

        Returns:
          (tokens [batch, length, emb_dim] for the input positions,
           mask [batch, length],
           pooled [batch, emb_dim], or None when ``pooling="none"``).
        """
        chex.assert_rank(inputs, 2)
        chex.assert_shape(mask, inputs.shape)
        chex.assert_type(inputs, int)
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"model.pooling={self.pooling!r} must be one of {POOLING_MODES}")
        batch, length = inputs.shape
        if length > self.max_len:
            raise ValueError(
                f"model.max_len={self.max_len} is shorter than the input length {length}"
            )
        mask = mask.astype(jnp.bool_)
        init = nn.initializers.normal(stddev=0.02)
        x = nn.Embed(self.vocab_size, self.emb_dim, embedding_init=init, name="token_embed")(inputs)
        if self.position_embedding == "learned":
            positions = nn.Embed(self.max_len, self.emb_dim, embedding_init=init, name="pos_embed")
            x = x + positions(jnp.arange(length))[None]
        elif self.position_embedding == "sinusoidal":
            x = x + sinusoidal_positions(length, self.emb_dim)[None].astype(x.dtype)
        elif self.position_embedding != "none":
            raise ValueError(
                f"model.position_embedding={self.position_embedding!r} is not one of "
                f"{POSITION_EMBEDDINGS}"
            )
        full_mask = mask
        if self.pooling == "cls":
            cls = self.param("cls", init, (1, 1, self.emb_dim))
            x = jnp.concatenate([jnp.broadcast_to(cls, (batch, 1, self.emb_dim)), x], axis=1)
            full_mask = jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), mask], axis=1)
        x = x.astype(self.dtype)
        x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
        scale = scaled_residual_factor(self.num_layers) if self.scaled_residual_init else 1.0
        # static_argnums counts self as 0: (x, mask, deterministic) are 1, 2, 3.
        block_cls = nn.remat(EncoderBlock, static_argnums=(3,)) if self.remat else EncoderBlock
        for layer in range(self.num_layers):
            block = block_cls(
                emb_dim=self.emb_dim,
                num_heads=self.num_heads,
                head_dim=self.head_dim,
                mlp_dim=self.mlp_dim,
                attention=self.attention,
                attention_options=self.attention_options,
                dropout=self.dropout,
                attention_dropout=self.attention_dropout,
                dtype=self.dtype,
                residual_init_scale=scale,
                query_key_init=self.query_key_init,
                name=f"block_{layer}",
            )
            if self.remat:
                # The recomputation waits for the backward pass on every backend
                # (XLA:CPU drops the barrier nn.remat relies on: sbm_jax._remat).
                x = call_recomputed_after_cotangent(
                    lambda mdl, x, mask: mdl(x, mask, deterministic), block, x, full_mask
                )
            else:
                x = block(x, full_mask, deterministic)
        if self.final_norm:
            x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        if self.pooling == "cls":
            pooled, tokens = x[:, 0], x[:, 1:]
        else:
            tokens = x
            pooled = masked_mean_pool(x, mask) if self.pooling == "mean" else None
        chex.assert_shape(tokens, (batch, length, self.emb_dim))
        return tokens, mask, pooled
