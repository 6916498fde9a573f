"""Reusable layers: tensor-train (MPO) dense layers."""

from sbm_jax.layers.tt import (
    TTDense,
    prime_factors,
    qtt_shapes,
    tt_contract,
    tt_core_shapes,
    tt_core_stddev,
    tt_cores_of,
    tt_modes,
    tt_num_params,
    tt_ranks,
    tt_to_dense,
)

__all__ = [
    "TTDense",
    "prime_factors",
    "qtt_shapes",
    "tt_contract",
    "tt_core_shapes",
    "tt_core_stddev",
    "tt_cores_of",
    "tt_modes",
    "tt_num_params",
    "tt_ranks",
    "tt_to_dense",
]
