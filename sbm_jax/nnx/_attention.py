"""NNX classes of the registered attention mechanisms and of the encoder."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from sbm_jax.attention.registry import get_mechanism
from sbm_jax.models.encoder import Encoder as LinenEncoder
from sbm_jax.nnx._face import LinenFace

# Length of the dummy sequence the parameters are initialised on. The parameter shapes
# depend on the width only, but some mechanisms want a sequence of a few blocks.
_INIT_LENGTH = 8


class Attention(LinenFace):
    """NNX face of one registered attention mechanism (``mechanism``: its registry name).

    Args:
      num_heads, head_dim: heads and per-head width.
      in_features: the input width (the Linen module learns it from its first input).
      out_dim: the output width (None: ``in_features``).
      attention_dropout: dropout on attention weights (the ``dropout`` stream).
      dtype: compute dtype.
      deterministic: the call's default (``eval()`` / ``train()`` set it).
      rngs: ``params`` (or ``default``) initialises; ``sample`` feeds the graph / feature
        sampling and ``dropout`` the dropout of every call (both fall back to ``default``).
      **options: the mechanism's own options (``model.attention_options`` in a config).

    Call: ``layer(x, mask)`` with x ``[batch, length, in_features]``, mask
    ``[batch, length]`` bool; or flax's ``MultiHeadAttention`` convention
    ``layer(inputs_q, inputs_k=None, inputs_v=None, mask=m)`` with m broadcastable to
    ``[batch, heads, q, k]`` (a key padding mask; see ``sbm_jax.attention._projections``).
    Cross-attention (``inputs_k`` / ``inputs_v`` of another sequence) runs where the
    mechanism supports it (``full``, ``linear``, ``performer``) and is refused in one line
    elsewhere. ``layer.stats`` holds what the call sowed (``layer.stats["density"]``
    ``[batch, heads]``, ...).
    """

    mechanism: ClassVar[str]

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        in_features: int,
        *,
        out_dim: int | None = None,
        attention_dropout: float = 0.0,
        dtype: Any = jnp.float32,
        deterministic: bool = False,
        rngs: nnx.Rngs,
        **options: Any,
    ) -> None:
        entry = get_mechanism(self.mechanism)
        owner = type(self).__name__
        fields = dict(
            num_heads=num_heads,
            head_dim=head_dim,
            out_dim=in_features if out_dim is None else out_dim,
            attention_dropout=attention_dropout,
            dtype=dtype,
        )
        options = entry.check_options(options, given=fields, field=owner)
        linen = entry.module(**fields, **options)
        x = jnp.zeros((1, _INIT_LENGTH, in_features), dtype)
        mask = jnp.ones((1, _INIT_LENGTH), jnp.bool_)
        super().__init__(
            linen,
            (x, mask),
            rngs=rngs,
            deterministic=deterministic,
            init_kwargs={"deterministic": True},
        )

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        """``[batch, length, in_features]`` -> ``[batch, length, out_dim]``; ``rngs``
        (optional) replaces the layer's own streams for this call."""
        return self._apply(
            inputs_q, inputs_k, inputs_v, mask=mask, rngs=rngs, deterministic=deterministic
        )


def attention_class(name: str) -> type[Attention]:
    """The NNX class of registered mechanism ``name`` (named as its Linen class)."""
    linen_cls = get_mechanism(name, field="mechanism").module
    cls = _CLASSES.get(name)
    if cls is None:
        cls = type(
            linen_cls.__name__,
            (Attention,),
            {
                "mechanism": name,
                "__module__": "sbm_jax.nnx",
                "__qualname__": linen_cls.__name__,
                "__doc__": f"NNX face of :class:`{linen_cls.__module__}.{linen_cls.__name__}`"
                f" (mechanism {name!r}).\n\n" + (Attention.__doc__ or ""),
            },
        )
        _CLASSES[name] = cls
    return cls


_CLASSES: dict[str, type[Attention]] = {}


def build_attention(
    name: str,
    *,
    num_heads: int,
    head_dim: int,
    in_features: int,
    rngs: nnx.Rngs,
    options: dict[str, Any] | None = None,
    **fields: Any,
) -> Attention:
    """The NNX layer of registered mechanism ``name`` (``options``: its own options)."""
    cls = attention_class(name)
    return cls(num_heads, head_dim, in_features, rngs=rngs, **fields, **dict(options or {}))


class Encoder(LinenFace):
    """NNX face of :class:`sbm_jax.models.encoder.Encoder` (same fields, same parameter
    tree): ``encoder(tokens, mask)`` -> ``(tokens [B, L, emb_dim], mask, pooled)``.

    ``encoder.stats`` holds every block's ``attention_stats`` under its Linen path
    (``encoder.stats["block_0"]["attention"]["density"]``)."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        emb_dim: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        mlp_dim: int,
        *,
        deterministic: bool = False,
        rngs: nnx.Rngs,
        **fields: Any,
    ) -> None:
        linen = LinenEncoder(
            vocab_size=vocab_size,
            max_len=max_len,
            emb_dim=emb_dim,
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            mlp_dim=mlp_dim,
            **fields,
        )
        length = min(_INIT_LENGTH, max_len)
        tokens = jnp.ones((1, length), jnp.int32)
        mask = jnp.ones((1, length), jnp.bool_)
        super().__init__(
            linen,
            (tokens, mask),
            rngs=rngs,
            deterministic=deterministic,
            init_kwargs={"deterministic": True},
        )

    def __call__(
        self,
        inputs: jax.Array,
        mask: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        return self._apply(inputs, mask, rngs=rngs, deterministic=deterministic)
