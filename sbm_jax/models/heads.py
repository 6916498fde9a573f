"""Output heads and the whole models built from an ``Encoder`` and a head.

* ``ClassificationHead``: Dense(hidden) -> ReLU -> Dense(classes) on a pooled vector.
* ``dual_encoder_features``: ``[x0, x1, x0 * x1, x0 - x1]`` for two pooled vectors
  (LRA Retrieval), fed to a ``ClassificationHead``.
* ``TokenHead``: per-token logits (the synthetic task; MLM later), optionally through a
  Dense -> GELU -> LayerNorm transform first.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.models.encoder import Encoder

Array = jax.Array


class ClassificationHead(nn.Module):
    """Dense(hidden_dim) -> ReLU -> Dense(num_classes): [batch, dim] -> [batch, classes]."""

    hidden_dim: int
    num_classes: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """x [batch, dim] -> logits [batch, num_classes] (float32)."""
        chex.assert_rank(x, 2)
        h = nn.relu(nn.Dense(self.hidden_dim, dtype=self.dtype, name="hidden")(x))
        logits = nn.Dense(self.num_classes, dtype=self.dtype, name="logits")(h)
        return logits.astype(jnp.float32)


def dual_encoder_features(x0: Array, x1: Array) -> Array:
    """Two pooled encodings [batch, dim] -> [batch, 4 * dim]: [x0, x1, x0*x1, x0-x1]."""
    chex.assert_rank(x0, 2)
    chex.assert_equal_shape((x0, x1))
    return jnp.concatenate([x0, x1, x0 * x1, x0 - x1], axis=-1)


class TokenHead(nn.Module):
    """Per-token logits: [batch, length, dim] -> [batch, length, num_classes].

    With ``hidden_dim > 0`` a Dense(hidden_dim) -> GELU -> LayerNorm transform comes
    first (the usual MLM head); with 0 it is a single Dense layer.
    """

    num_classes: int
    hidden_dim: int = 0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """x [batch, length, dim] -> logits [batch, length, num_classes] (float32)."""
        chex.assert_rank(x, 3)
        if self.hidden_dim > 0:
            x = nn.gelu(nn.Dense(self.hidden_dim, dtype=self.dtype, name="transform")(x))
            x = nn.LayerNorm(dtype=self.dtype, name="transform_ln")(x)
        logits = nn.Dense(self.num_classes, dtype=self.dtype, name="logits")(x)
        return logits.astype(jnp.float32)


class SequenceClassifier(nn.Module):
    """Encoder -> pooled vector -> ClassificationHead."""

    encoder: Encoder
    head: ClassificationHead

    def __call__(self, inputs: Array, mask: Array, *, deterministic: bool) -> Array:
        """inputs [batch, length] int, mask [batch, length] -> logits [batch, classes]."""
        if self.encoder.pooling == "none":
            raise ValueError("model.pooling='none' cannot feed a sequence classification head")
        _, _, pooled = self.encoder(inputs, mask, deterministic=deterministic)
        assert pooled is not None  # pooling != "none" was checked above
        return self.head(pooled)


class TokenClassifier(nn.Module):
    """Encoder -> TokenHead on every position."""

    encoder: Encoder
    head: TokenHead

    def __call__(self, inputs: Array, mask: Array, *, deterministic: bool) -> Array:
        """inputs [batch, length] int, mask [batch, length] -> [batch, length, classes]."""
        tokens, _, _ = self.encoder(inputs, mask, deterministic=deterministic)
        return self.head(tokens)


class DualEncoderClassifier(nn.Module):
    """One shared encoder on two sequences -> [x0, x1, x0*x1, x0-x1] -> ClassificationHead.

    Both sequences go through the encoder as one batch of size 2 * batch, so the encoder
    runs once.
    """

    encoder: Encoder
    head: ClassificationHead

    def __call__(
        self, inputs0: Array, mask0: Array, inputs1: Array, mask1: Array, *, deterministic: bool
    ) -> Array:
        """Two id/mask pairs, each [batch, length] -> logits [batch, classes]."""
        chex.assert_equal_shape((inputs0, mask0, inputs1, mask1))
        if self.encoder.pooling == "none":
            raise ValueError("model.pooling='none' cannot feed a dual-encoder head")
        batch = inputs0.shape[0]
        inputs = jnp.concatenate([inputs0, inputs1], axis=0)
        mask = jnp.concatenate([mask0, mask1], axis=0)
        _, _, pooled = self.encoder(inputs, mask, deterministic=deterministic)
        assert pooled is not None  # pooling != "none" was checked above
        features = dual_encoder_features(pooled[:batch], pooled[batch:])
        return self.head(features)
