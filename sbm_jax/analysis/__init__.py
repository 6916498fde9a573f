"""Analytic cost models of the attention mechanisms: parameter counts and FLOPs."""

from sbm_jax.analysis.flops import (
    LRA_SEQ_LENS,
    attention_flops,
    attention_param_count,
    counted_mechanisms,
    flops_table,
    pattern_edges,
)

__all__ = [
    "LRA_SEQ_LENS",
    "attention_flops",
    "attention_param_count",
    "counted_mechanisms",
    "flops_table",
    "pattern_edges",
]
