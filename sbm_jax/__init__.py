"""sbm-jax: SBM-Transformer attention whose cost follows its sampled edges.

The public names load their module on first use (PEP 562), so that importing the
array-level core (``sbm_jax.graph``, ``sbm_jax.fastrg``, ``sbm_jax.edge_ops``) loads
neither flax nor the attention mechanisms. ``sbm_jax.nnx`` (the Flax NNX face) is one
of them: ``import sbm_jax; sbm_jax.nnx.SBMAttention`` loads it, and flax, on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sbm_jax import nnx as nnx
    from sbm_jax.attention.sbm import SBMAttention
    from sbm_jax.edge_ops import dense_masked_attention, edge_attention, edge_softmax
    from sbm_jax.fastrg import sample_sbm_graph
    from sbm_jax.graph import EdgeList
    from sbm_jax.ste import straight_through

# public name -> the module that defines it
_LAZY = {
    "EdgeList": "sbm_jax.graph",
    "SBMAttention": "sbm_jax.attention.sbm",
    "dense_masked_attention": "sbm_jax.edge_ops",
    "edge_attention": "sbm_jax.edge_ops",
    "edge_softmax": "sbm_jax.edge_ops",
    "sample_sbm_graph": "sbm_jax.fastrg",
    "straight_through": "sbm_jax.ste",
}
# public submodules, loaded on first use as the names above; left out of ``__all__`` so
# that ``from sbm_jax import *`` never shadows a user's ``from flax import nnx``
_SUBMODULES = {"nnx": "sbm_jax.nnx"}

__all__ = [
    "EdgeList",
    "SBMAttention",
    "dense_masked_attention",
    "edge_attention",
    "edge_softmax",
    "sample_sbm_graph",
    "straight_through",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value: Any = importlib.import_module(_SUBMODULES[name])
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
