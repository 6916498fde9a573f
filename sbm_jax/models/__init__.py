"""Encoder and heads; ``build_model`` makes one from a config's ``model`` section."""

from sbm_jax.models.build import HEAD_KINDS, build_encoder, build_model, model_dtype
from sbm_jax.models.encoder import POOLING_MODES, Encoder, EncoderBlock, MlpBlock, masked_mean_pool
from sbm_jax.models.heads import (
    ClassificationHead,
    DualEncoderClassifier,
    SequenceClassifier,
    TokenClassifier,
    TokenHead,
    dual_encoder_features,
)

__all__ = [
    "HEAD_KINDS",
    "POOLING_MODES",
    "ClassificationHead",
    "DualEncoderClassifier",
    "Encoder",
    "EncoderBlock",
    "MlpBlock",
    "SequenceClassifier",
    "TokenClassifier",
    "TokenHead",
    "build_encoder",
    "build_model",
    "dual_encoder_features",
    "masked_mean_pool",
    "model_dtype",
]
