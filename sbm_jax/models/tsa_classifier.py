"""The seven-layer text classifier of the TSA paper (Xu et al. 2021, sec. 6).

(i) word embedding, (ii) multi-head (H = 2) Tensorized Spectral Attention, (iii) global
average pooling over real tokens, (iv) dropout 10%, (v) dense 20 + relu, (vi) dropout
10%, (vii) dense num_classes. The paper's final softmax is left to the loss: the module
returns logits (``jax.nn.softmax(logits)`` gives the paper's probabilities).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.attention.tsa import TensorizedSpectralAttention

Array = jax.Array


class TSAClassifier(nn.Module):
    """inputs [B, L] int, mask [B, L] bool -> logits [B, num_classes].

    Attributes:
      vocab_size: embedding rows (the paper keeps the 20,000 most common words).
      num_classes: output classes.
      embed_dim: token embedding size I (a power of two gives the QTT setting).
      num_heads: TSA heads (paper: 2).
      head_dim: per-head key/value size; None means embed_dim.
      hidden_dim: units of the relu dense layer (paper: 20).
      dropout_rate: both dropout layers (paper: 0.1).
      damping, projection, tt_rank, use_bias, attention_dropout: passed to TSA.
      dtype: compute dtype.
    """

    vocab_size: int
    num_classes: int
    embed_dim: int = 16
    num_heads: int = 2
    head_dim: int | None = None
    hidden_dim: int = 20
    dropout_rate: float = 0.1
    damping: float = 0.9
    projection: str = "tt"
    tt_rank: int = 2
    use_bias: bool = False
    attention_dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs: Array, mask: Array, *, deterministic: bool) -> Array:
        """inputs: [batch, length] int token ids; mask: [batch, length] bool
        -> [batch, num_classes] logits (the same call as the encoder's classifiers)."""
        tokens = inputs
        for field in ("vocab_size", "num_classes", "embed_dim", "hidden_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TSAClassifier.{field}={value!r} must be a positive integer")
        if not 0.0 <= float(self.dropout_rate) < 1.0:
            raise ValueError(f"TSAClassifier.dropout_rate={self.dropout_rate!r} must be in [0, 1)")
        if tokens.ndim != 2 or mask.shape != tokens.shape:
            raise ValueError(
                f"tokens {tokens.shape} and mask {mask.shape} must both be [batch, length]"
            )
        mask = mask.astype(bool)
        x = nn.Embed(self.vocab_size, self.embed_dim, dtype=self.dtype, name="embed")(tokens)
        x = TensorizedSpectralAttention(
            num_heads=self.num_heads,
            head_dim=self.head_dim or self.embed_dim,
            out_dim=self.embed_dim,
            attention_dropout=self.attention_dropout,
            dtype=self.dtype,
            damping=self.damping,
            projection=self.projection,
            tt_rank=self.tt_rank,
            use_bias=self.use_bias,
            name="tsa",
        )(x, mask, deterministic=deterministic)  # [B, L, embed_dim]
        weights = mask.astype(x.dtype)[..., None]
        count = jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        pooled = jnp.sum(x * weights, axis=1) / count  # [B, embed_dim]
        h = nn.Dropout(self.dropout_rate)(pooled, deterministic=deterministic)
        h = nn.relu(nn.Dense(self.hidden_dim, dtype=self.dtype, name="hidden")(h))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="logits")(h)
