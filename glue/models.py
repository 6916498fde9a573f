"""The MLM model (encoder + token head scored only at masked positions) and the
transplant of a pretrained encoder into a fresh classifier."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from sbm_jax.models import Encoder, TokenHead, build_encoder, model_dtype

Array = jax.Array


class MaskedLanguageModel(nn.Module):
    """Encoder, then a token head (Dense -> GELU -> LayerNorm -> Dense(vocab)) applied to
    the gathered ``positions`` only, so logits are [batch, P, vocab], not [batch, length,
    vocab]."""

    encoder: Encoder
    head: TokenHead

    def __call__(
        self, inputs: Array, mask: Array, positions: Array, *, deterministic: bool
    ) -> Array:
        """inputs, mask [batch, length]; positions int [batch, P] -> logits [batch, P, vocab]."""
        chex.assert_rank(positions, 2)
        tokens, _, _ = self.encoder(inputs, mask, deterministic=deterministic)
        gathered = jnp.take_along_axis(tokens, positions[..., None].astype(jnp.int32), axis=1)
        return self.head(gathered)


def build_mlm_model(model: Any) -> MaskedLanguageModel:
    """The MLM model of a ``model`` config section (head width ``model.token_head_dim``)."""
    return MaskedLanguageModel(
        encoder=build_encoder(model),
        head=TokenHead(
            int(model.vocab_size),
            int(model.get("token_head_dim", 0)),
            model_dtype(str(model.get("dtype", "float32"))),
        ),
    )


def mlm_model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``MaskedLanguageModel`` from an MLM batch."""
    return {"inputs": batch["inputs"], "mask": batch["mask"], "positions": batch["positions"]}


def transplant_encoder(fresh: Mapping[str, Any], pretrained: Mapping[str, Any]) -> dict[str, Any]:
    """``fresh`` classifier params with ``fresh["encoder"]`` replaced by the pretrained
    encoder; every leaf's shape must match (errors name the parameter path)."""
    if "encoder" not in pretrained:
        raise ValueError("the pretraining checkpoint holds no 'encoder' parameters")
    flat_fresh = {
        jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(fresh["encoder"])
    }
    flat_old = {
        jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_leaves_with_path(pretrained["encoder"])
    }
    missing = sorted(set(flat_fresh) - set(flat_old))
    extra = sorted(set(flat_old) - set(flat_fresh))
    if missing or extra:
        raise ValueError(
            f"encoder parameters differ from the checkpoint's: missing {missing[:5]}, "
            f"unexpected {extra[:5]} (check model.attention and model.pooling)"
        )
    for key, value in flat_fresh.items():
        if tuple(value.shape) != tuple(flat_old[key].shape):
            raise ValueError(
                f"encoder parameter {key} has shape {tuple(value.shape)} here but "
                f"{tuple(flat_old[key].shape)} in the checkpoint"
            )
    encoder = jax.tree.map(
        lambda new, old: jnp.asarray(old, new.dtype), fresh["encoder"], dict(pretrained["encoder"])
    )
    return {**dict(fresh), "encoder": encoder}
