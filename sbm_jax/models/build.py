"""Build models from a config's ``model`` section (an ``ml_collections.ConfigDict``).

Fields read (each documented where a config file sets it):
``vocab_size, max_len, emb_dim, num_layers, num_heads, head_dim, mlp_dim, attention,
attention_options, dropout, attention_dropout, pooling, classifier_dim, num_classes,
dtype`` and, for token heads, ``token_head_dim`` (optional, default 0); optional
``remat`` and ``scaled_residual_init`` (the Sparse Transformer's training aids),
``query_key_init``, ``position_embedding`` and ``final_norm``, whose defaults are the
``Encoder``'s (``ENCODER_DEFAULTS``); see ``sbm_jax.models.encoder``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from sbm_jax.models.encoder import POSITION_EMBEDDINGS, QUERY_KEY_INITS, Encoder
from sbm_jax.models.heads import (
    ClassificationHead,
    DualEncoderClassifier,
    SequenceClassifier,
    TokenClassifier,
    TokenHead,
)
from sbm_jax.models.tsa_classifier import TSAClassifier

HEAD_KINDS = ("classification", "token", "dual_encoder")

#: The encoder's optional ``model`` fields and their defaults, read from the ``Encoder``
#: module's own fields (the one place they are written): what a config, or an older
#: run's saved config, that leaves one out gets.
ENCODER_DEFAULTS: dict[str, Any] = {
    name: Encoder.__dataclass_fields__[name].default
    for name in (
        "remat",
        "scaled_residual_init",
        "query_key_init",
        "position_embedding",
        "final_norm",
    )
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def model_dtype(name: str) -> Any:
    """Config dtype name -> jnp dtype; the error names ``model.dtype``."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype={name!r} must be one of {sorted(_DTYPES)}") from None


def _options(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return dict(value)
    raise ValueError(f"model.attention_options must be a mapping, got {type(value).__name__}")


def _flag(model: Any, name: str) -> bool:
    """Optional boolean ``model.<name>``; anything else names the field."""
    value = model.get(name, ENCODER_DEFAULTS[name])
    if not isinstance(value, bool):
        raise ValueError(f"model.{name}={value!r} must be True or False")
    return value


def _choice(model: Any, name: str, choices: tuple[str, ...]) -> str:
    """Optional string ``model.<name>`` from ``choices``; anything else names the field."""
    value = model.get(name, ENCODER_DEFAULTS[name])
    if value not in choices:
        raise ValueError(f"model.{name}={value!r} must be one of {choices}")
    return str(value)


def build_encoder(model: Any) -> Encoder:
    """An ``Encoder`` configured from the ``model`` config section."""
    return Encoder(
        vocab_size=int(model.vocab_size),
        max_len=int(model.max_len),
        emb_dim=int(model.emb_dim),
        num_layers=int(model.num_layers),
        num_heads=int(model.num_heads),
        head_dim=int(model.head_dim),
        mlp_dim=int(model.mlp_dim),
        attention=str(model.attention),
        attention_options=_options(model.get("attention_options")),
        dropout=float(model.dropout),
        attention_dropout=float(model.attention_dropout),
        pooling=str(model.pooling),
        dtype=model_dtype(str(model.get("dtype", "float32"))),
        remat=_flag(model, "remat"),
        scaled_residual_init=_flag(model, "scaled_residual_init"),
        query_key_init=_choice(model, "query_key_init", QUERY_KEY_INITS),
        position_embedding=_choice(model, "position_embedding", POSITION_EMBEDDINGS),
        final_norm=_flag(model, "final_norm"),
    )


ARCHITECTURES = ("encoder", "tsa_classifier")


def build_tsa_classifier(model: Any) -> TSAClassifier:
    """The TSA paper's seven-layer text classifier from the ``model`` config section."""
    tsa = _options(model.get("attention_options"))
    return TSAClassifier(
        vocab_size=int(model.vocab_size),
        num_classes=int(model.num_classes),
        embed_dim=int(model.emb_dim),
        num_heads=int(model.num_heads),
        head_dim=int(model.head_dim),
        hidden_dim=int(model.classifier_dim),
        dropout_rate=float(model.dropout),
        attention_dropout=float(model.attention_dropout),
        dtype=model_dtype(str(model.get("dtype", "float32"))),
        **tsa,
    )


def build_model(model: Any, head: str) -> nn.Module:
    """Encoder plus the ``head`` a task asks for ("classification", "token", "dual_encoder"),
    or, with ``model.architecture="tsa_classifier"``, the TSA paper's text classifier."""
    architecture = str(model.get("architecture", "encoder"))
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model.architecture={architecture!r} is not one of {ARCHITECTURES}")
    if architecture == "tsa_classifier":
        if head != "classification":
            raise ValueError(
                f"model.architecture='tsa_classifier' is a sequence classifier; "
                f"the task asks for a {head!r} head"
            )
        if str(model.attention) != "tsa":
            raise ValueError("model.architecture='tsa_classifier' needs model.attention='tsa'")
        return build_tsa_classifier(model)
    encoder = build_encoder(model)
    dtype = encoder.dtype
    if head == "classification":
        return SequenceClassifier(
            encoder=encoder,
            head=ClassificationHead(int(model.classifier_dim), int(model.num_classes), dtype),
        )
    if head == "dual_encoder":
        return DualEncoderClassifier(
            encoder=encoder,
            head=ClassificationHead(int(model.classifier_dim), int(model.num_classes), dtype),
        )
    if head == "token":
        return TokenClassifier(
            encoder=encoder,
            head=TokenHead(int(model.num_classes), int(model.get("token_head_dim", 0)), dtype),
        )
    raise ValueError(f"head {head!r} is not one of {HEAD_KINDS}")
