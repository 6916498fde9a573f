"""sbm-jax for Flax NNX: every registered attention mechanism and the encoder as
``nnx.Module`` classes, sharing the Linen modules' math and parameter trees.

    from flax import nnx
    from sbm_jax import nnx as sbm_nnx

    layer = sbm_nnx.SBMAttention(
        num_heads=8, head_dim=64, in_features=512, rngs=nnx.Rngs(0, sample=1)
    )
    y = layer(x, mask)          # sampling draws from the rngs' "sample" stream
    layer.stats["density"]      # [batch, heads], what this call sampled

Each class is a thin :class:`LinenFace` around the Linen module of the same name (see
docs/architecture.md, "The NNX face"): ``layer.linen_params()`` is the Linen ``params``
tree and ``layer.load_linen_params(params)`` loads one. The names load their modules on
first use, so ``from sbm_jax import nnx`` loads no mechanism.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sbm_jax.nnx._attention import Attention, Encoder, attention_class, build_attention
    from sbm_jax.nnx._face import AttentionStats, LinenFace

# class name -> registry name of the mechanism it faces
MECHANISMS = {
    "FullAttention": "full",
    "LinearAttention": "linear",
    "LinformerAttention": "linformer",
    "LocalAttention": "local",
    "NystromformerAttention": "nystromformer",
    "PerformerAttention": "performer",
    "ReformerAttention": "reformer",
    "SBMAttention": "sbm",
    "SparseFixedAttention": "sparse_fixed",
    "SparseStridedAttention": "sparse_strided",
    "TensorizedSpectralAttention": "tsa",
}

_LAZY = {
    "Attention": "sbm_jax.nnx._attention",
    "Encoder": "sbm_jax.nnx._attention",
    "attention_class": "sbm_jax.nnx._attention",
    "build_attention": "sbm_jax.nnx._attention",
    "AttentionStats": "sbm_jax.nnx._face",
    "LinenFace": "sbm_jax.nnx._face",
}

__all__ = [
    "Attention",
    "AttentionStats",
    "Encoder",
    "FullAttention",
    "LinearAttention",
    "LinenFace",
    "LinformerAttention",
    "LocalAttention",
    "NystromformerAttention",
    "PerformerAttention",
    "ReformerAttention",
    "SBMAttention",
    "SparseFixedAttention",
    "SparseStridedAttention",
    "TensorizedSpectralAttention",
    "attention_class",
    "build_attention",
]


def __getattr__(name: str) -> Any:
    if name in MECHANISMS:
        value: Any = importlib.import_module("sbm_jax.nnx._attention").attention_class(
            MECHANISMS[name]
        )
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
