"""sbm-jax: SBM-Transformer attention whose cost follows its sampled edges.

The public names load their module on first use (PEP 562), so that importing the
array-level core (``sbm_jax.graph``, ``sbm_jax.fastrg``, ``sbm_jax.edge_ops``) loads
neither flax nor the attention mechanisms.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
