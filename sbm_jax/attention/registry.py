"""One registry for attention mechanisms, keyed by the name a config uses.

Contract every registered mechanism keeps (the encoder relies on it):

* It is a ``flax.linen.Module`` whose constructor takes the keyword fields
  ``num_heads: int``, ``head_dim: int``, ``out_dim: int`` (model width),
  ``attention_dropout: float`` and ``dtype`` (compute dtype), plus its own options
  (each with a default), which come from ``config.model.attention_options``.
* ``__call__(x, mask, *, deterministic)`` with ``x [batch, length, dim]`` and
  ``mask [batch, length]`` (bool, True for real tokens) returns
  ``[batch, length, out_dim]``. Padded positions never influence real positions.
* Randomness only from the named rng streams ``dropout`` and ``sample``.
* Statistics for logging go to the ``attention_stats`` collection with ``self.sow``:
  ``density [batch, heads]`` (differentiable where the mechanism's density is, e.g.
  SBM through the straight-through estimator) and ``edges [batch, heads]``. A mechanism
  may sow more entries under other names; the trainer reads ``density``, ``edges`` and
  ``overflow`` by name and ignores the rest (unused entries cost nothing under ``jit``).
  SBM adds ``overflow [batch, heads]`` bool, ``path []`` and the per-token expected
  densities ``query_density`` and ``key_density [batch, heads, length]`` (0 at padded
  positions), which reports read instead of re-deriving the layer.
* Larger per-token arrays go to a separate collection that is sown only when the
  caller makes it mutable (``self.is_mutable_collection``), so they cost nothing
  otherwise: SBM sows ``q_memberships``, ``k_memberships [batch, heads, length, k]``
  and ``block [heads, k, k]`` into ``attention_maps``
  (``sbm_jax.attention.sbm.MAPS_COLLECTION``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn

STATS_COLLECTION = "attention_stats"

_REGISTRY: dict[str, type[nn.Module]] = {}


def register(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator that registers an attention module under ``name``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention mechanism {name!r} is registered twice")
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    """Sorted names of every registered mechanism."""
    _import_builtin()
    return sorted(_REGISTRY)


def get_attention(name: str, field: str = "model.attention") -> type[nn.Module]:
    """The module class registered as ``name``; the error names the config ``field``."""
    _import_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"{field}={name!r} is not a known attention mechanism; choose one of {available()}"
        ) from None


def build_attention(
    name: str, *, options: dict[str, Any] | None = None, **fields: Any
) -> nn.Module:
    """Instantiate mechanism ``name`` with the common ``fields`` and its ``options``.

    Unknown option names fail with a message naming ``model.attention_options.<opt>``.
    """
    cls = get_attention(name)
    options = dict(options or {})
    known = set(getattr(cls, "__dataclass_fields__", {}))
    for key in options:
        if key not in known:
            raise ValueError(
                f"model.attention_options.{key} is not an option of attention {name!r}; "
                f"its options are {sorted(known - {'parent', 'name'} - set(fields))}"
            )
    return cls(**fields, **options)


def _import_builtin() -> None:
    # Importing the package registers the built-in mechanisms.
    import sbm_jax.attention  # noqa: F401
