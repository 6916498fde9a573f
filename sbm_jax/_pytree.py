"""A frozen dataclass that is a JAX pytree, without flax.

``import flax.struct`` runs ``flax/__init__.py``, which loads ``flax.linen``; the
array-level core (:mod:`sbm_jax.graph`, :mod:`sbm_jax.fastrg`) uses this instead so that
importing it loads no flax module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self, dataclass_transform

import jax


@dataclass_transform(frozen_default=True)
class PyTreeDataclass:
    """Base class: each subclass becomes a frozen dataclass registered as a pytree.

    Every field is a pytree child (traced under ``jit``, mapped by ``vmap``) unless it is
    declared ``dataclasses.field(metadata={"static": True})``, which makes it part of the
    tree structure (hashable, static under ``jit``). ``replace`` returns a copy with some
    fields changed. Same behaviour as ``flax.struct.PyTreeNode``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        jax.tree_util.register_dataclass(cls)

    def replace(self, **updates: Any) -> Self:
        """A copy with the fields in ``updates`` replaced."""
        return dataclasses.replace(self, **updates)  # type: ignore[type-var]
