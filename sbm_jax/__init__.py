"""sbm-jax: SBM-Transformer attention whose cost follows its sampled edges."""

from sbm_jax.attention.sbm import SBMAttention
from sbm_jax.edge_ops import dense_masked_attention, edge_attention, edge_softmax
from sbm_jax.fastrg import sample_sbm_graph
from sbm_jax.graph import EdgeList
from sbm_jax.ste import straight_through

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
