"""Attention statistics sown by mechanisms into the ``attention_stats`` collection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from sbm_jax.attention import STATS_COLLECTION

Array = jax.Array


def sown_per_module(collection: Mapping[str, Any], stat: str) -> dict[str, Array]:
    """{module path: sown ``stat`` concatenated over calls, ``[calls * batch, heads]``}.

    ``collection``: the sown statistics (``variables[STATS_COLLECTION]``)."""
    flat = traverse_util.flatten_dict(dict(collection))
    out = {}
    for path, values in sorted(flat.items()):
        if path[-1] != stat:
            continue
        values = values if isinstance(values, tuple) else (values,)
        out["/".join(str(p) for p in path[:-1])] = jnp.concatenate(
            [jnp.asarray(v, jnp.float32).reshape(-1, v.shape[-1]) for v in values], axis=0
        )
    return out


def collect_attention_stats(variables: Mapping[str, Any]) -> dict[str, Any]:
    """Summaries of the sown attention statistics.

    Args:
      variables: the mutable collections returned by ``apply(..., mutable=[...])``; only
        ``variables["attention_stats"]`` is read (missing -> no statistics).

    Returns:
      A dict with, where sown: ``density`` (scalar mean over every layer, head and
      example; differentiable where the mechanism's density is), ``density_per_head``
      {module path: [heads]}, ``edges`` (scalar mean per example and head),
      ``edges_per_head`` {module path: [heads]}, and from SBM's ``overflow [batch,
      heads]`` (draws above the largest capacity bucket): ``overflow`` (the number of
      (example, head) graphs that overflowed, over every layer) and
      ``overflow_per_layer`` {module path: count}. Empty when nothing was sown.
    """
    collection = variables.get(STATS_COLLECTION, {})
    stats: dict[str, Any] = {}
    for stat in ("density", "edges"):
        per_module = sown_per_module(collection, stat)
        if not per_module:
            continue
        stats[stat] = jnp.mean(jnp.stack([jnp.mean(v) for v in per_module.values()]))
        stats[f"{stat}_per_head"] = {k: jnp.mean(v, axis=0) for k, v in per_module.items()}
    overflow = sown_per_module(collection, "overflow")
    if overflow:
        counts = {k: jnp.sum(v > 0).astype(jnp.float32) for k, v in overflow.items()}
        stats["overflow"] = jnp.sum(jnp.stack(list(counts.values())))
        stats["overflow_per_layer"] = counts
    return stats
