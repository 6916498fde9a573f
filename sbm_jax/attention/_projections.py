"""Shared pieces of the low-rank / kernel baselines (linear, performer, linformer, nystromformer).

Each of these mechanisms makes the same per-head Q/K/V projections and the same output
projection as the other registered mechanisms (``query``, ``key``, ``value``, ``out``
``DenseGeneral`` layers), checks its inputs the same way, and does its numerically
delicate work (exponentials, normalisers, pseudo-inverses) in at least float32.

Every mechanism's parameters carry logical axis names (flax partitioning metadata,
``nn.with_logical_partitioning``): ``heads`` names a per-head axis, the other names
(``embed``, ``kv``, ...) the rest. ``sbm_jax.training.sharding`` maps ``heads`` to the
mesh's ``heads`` axis and every other name to replication, so a mechanism's per-head
parameters split over ``heads`` whatever the parameters are called. ``Module.init``
returns the parameters boxed (``nn.Partitioned``); ``nn.unbox`` gives the plain arrays.
"""

from __future__ import annotations

import numbers
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

# Finite stand-in for -inf in masked logits: a fully masked row then gives a uniform
# softmax (finite, and discarded by the caller) instead of NaN in the forward or backward.
MASKED_LOGIT = -1e30

# Logical axis names of the mechanisms' parameters.
HEADS = "heads"  # a per-head axis: split over the mesh's ``heads`` axis
EMBED = "embed"  # the model width (input of the projections, output of ``out``)
KV = "kv"  # the per-head width of queries, keys and values

# flax's own defaults of ``DenseGeneral``, so the names change no initial value.
_KERNEL_INIT = nn.initializers.lecun_normal()
_BIAS_INIT = nn.initializers.zeros_init()


def named(init: nn.initializers.Initializer, *names: str | None) -> Any:
    """``init`` whose parameter carries the logical axis names ``names`` (one per axis)."""
    return nn.with_logical_partitioning(init, names)


def head_dense(
    num_heads: int, head_dim: int, dtype: Any, name: str, use_bias: bool = True
) -> nn.DenseGeneral:
    """Per-head projection x [..., dim] -> [..., num_heads, head_dim]: kernel
    ``[dim, H, hd]`` named ``(embed, heads, kv)``, bias ``[H, hd]`` named ``(heads, kv)``."""
    return nn.DenseGeneral(
        (num_heads, head_dim),
        use_bias=use_bias,
        dtype=dtype,
        kernel_init=named(_KERNEL_INIT, EMBED, HEADS, KV),
        bias_init=named(_BIAS_INIT, HEADS, KV),
        name=name,
    )


def out_dense(out_dim: int, dtype: Any, name: str = "out") -> nn.DenseGeneral:
    """Output projection y [..., H, hd] -> [..., out_dim]: kernel ``[H, hd, out_dim]``
    named ``(heads, kv, embed)``, bias ``[out_dim]`` named ``(embed,)``."""
    return nn.DenseGeneral(
        out_dim,
        axis=(-2, -1),
        dtype=dtype,
        kernel_init=named(_KERNEL_INIT, HEADS, KV, EMBED),
        bias_init=named(_BIAS_INIT, EMBED),
        name=name,
    )


def check_int(field: str, value: Any, minimum: int = 1) -> None:
    """Raise a ValueError naming ``field`` unless ``value`` is an integer (Python or
    NumPy; not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}, got {value!r}")


def check_real(field: str, value: Any, minimum: float = 0.0) -> None:
    """Raise a ValueError naming ``field`` unless ``value`` is a real number (int or
    float; not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= minimum:  # type: ignore[operator]
        raise ValueError(f"{field} must be a number >= {minimum}, got {value!r}")


def check_fields(module: nn.Module) -> None:
    """The fields every mechanism has: ``num_heads``, ``head_dim`` and ``out_dim`` ints
    >= 1 (``out_dim`` may be None where the module defaults it to the input width) and
    ``attention_dropout`` (where the module has it) in [0, 1). Raises a ValueError naming
    the field, before anything is traced."""
    check_int("num_heads", module.num_heads)
    check_int("head_dim", module.head_dim)
    if getattr(module, "out_dim", None) is not None:
        check_int("out_dim", module.out_dim)
    rate = getattr(module, "attention_dropout", 0.0)
    if not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:  # type: ignore[operator]
        raise ValueError(f"attention_dropout must lie in [0, 1), got {rate!r}")


def check_inputs(x: Array, mask: Array) -> None:
    """Raise a ValueError unless x is [batch, length, dim] with length >= 1 and mask is
    [batch, length]."""
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, length, dim], got shape {x.shape}")
    if x.shape[1] < 1:
        raise ValueError(f"x must have at least one position (length >= 1), got shape {x.shape}")
    if mask.shape != x.shape[:2]:
        raise ValueError(f"mask shape {mask.shape} must equal x.shape[:2]={x.shape[:2]}")


def check_call(module: nn.Module, x: Array, mask: Array) -> None:
    """:func:`check_fields` and :func:`check_inputs`: the first lines of every
    mechanism's ``__call__``."""
    check_fields(module)
    check_inputs(x, mask)


def _name(module: Any) -> str:
    return type(module).__name__


#: The registered mechanisms whose bodies attend one sequence to another
#: (:func:`cross_attention_call`); every other one refuses cross-attention in one line.
CROSS_ATTENTION = ("full", "linear", "performer")


def _key_mask_from_pairs(module: Any, mask: Array, batch: int, q_len: int, k_len: int) -> Array:
    """A ``[batch, heads, q, k]``-broadcastable ``mask`` -> the key-padding mask
    ``[batch, k]`` it amounts to, or a ValueError when it is a pair mask (one that varies
    along heads or queries: causal, banded, arbitrary) the mechanism cannot honour."""
    name = _name(module)
    full = (batch, module.num_heads, q_len, k_len)
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if mask.ndim > 4 or any(s not in (1, f) for s, f in zip(shape, full, strict=True)):
        raise ValueError(
            f"{name}: mask shape {tuple(mask.shape)} does not broadcast to "
            f"[batch, heads, q, k] = {full}"
        )
    mask = jnp.reshape(mask, shape).astype(jnp.bool_)
    if shape[1] > 1 or shape[2] > 1:
        # Only a mask that is the same for every head and query is a key-padding mask;
        # that can be seen only on concrete values (not on a traced mask inside jit).
        if isinstance(mask, jax.core.Tracer) or not bool(jnp.all(mask == mask[:, :1, :1, :])):
            raise ValueError(
                f"{name} honours only a key-padding mask, and mask of shape "
                f"{tuple(mask.shape)} varies along heads or queries (a causal or pair mask)"
                " or is traced so that cannot be checked: pass a [batch, k] or "
                "[batch, 1, 1, k] mask"
            )
    return jnp.broadcast_to(mask[:, 0, 0, :], (batch, k_len))


def _read_call(
    module: nn.Module,
    inputs_q: Array,
    inputs_k: Array | None,
    inputs_v: Array | None,
    mask: Array | None,
) -> tuple[Array, Array, Array, Array]:
    """Both call conventions -> ``(x_q, x_k, x_v, key_mask [batch, k] bool)``, checked;
    ``x_k`` and ``x_v`` are ``x_q`` itself when not given (flax's rule: ``inputs_v``
    defaults to ``inputs_k``, which defaults to ``inputs_q``)."""
    name = _name(module)
    check_fields(module)
    if inputs_k is not None and getattr(inputs_k, "ndim", 3) <= 2:
        if mask is not None:
            raise ValueError(
                f"{name}: got a [batch, length] mask as the second argument and mask= too"
            )
        inputs_k, mask = None, inputs_k
    if inputs_v is not None and inputs_k is None:
        raise ValueError(f"{name}: inputs_v was given without inputs_k")
    x_q = inputs_q
    x_k = x_q if inputs_k is None else inputs_k
    x_v = x_k if inputs_v is None else inputs_v
    for role, x in (("x", x_q), ("inputs_k", x_k), ("inputs_v", x_v)):
        if x.ndim != 3:
            raise ValueError(f"{role} must be [batch, length, dim], got shape {x.shape}")
        if x.shape[1] < 1:
            raise ValueError(
                f"{role} must have at least one position (length >= 1), got shape {x.shape}"
            )
    batch, q_len = x_q.shape[:2]
    k_len = x_k.shape[1]
    if x_k.shape[0] != batch or x_v.shape[:2] != x_k.shape[:2]:
        raise ValueError(
            f"{name}: inputs_k and inputs_v must be [batch, k, dim] with inputs_q's batch "
            f"and one length k; got shapes q, k, v = {x_q.shape}, {x_k.shape}, {x_v.shape}"
        )
    if mask is None:
        mask = jnp.ones((batch, k_len), jnp.bool_)
    elif mask.ndim == 2:
        # Today's [batch, length] mask: the keys' (the sequence's, when attending to itself).
        if tuple(mask.shape) != (batch, k_len):
            raise ValueError(
                f"mask shape {tuple(mask.shape)} must equal the keys' [batch, k] = {(batch, k_len)}"
            )
    elif mask.ndim < 2:
        raise ValueError(
            f"{name}: mask shape {tuple(mask.shape)} does not broadcast to "
            f"[batch, heads, q, k] = {(batch, module.num_heads, q_len, k_len)}"
        )
    else:
        mask = _key_mask_from_pairs(module, mask, batch, q_len, k_len)
    return x_q, x_k, x_v, mask.astype(jnp.bool_)


def attention_call(
    module: nn.Module,
    inputs_q: Array,
    inputs_k: Array | None = None,
    inputs_v: Array | None = None,
    mask: Array | None = None,
) -> tuple[Array, Array]:
    """The first line of a self-attention mechanism's ``__call__``: both call conventions
    -> the checked ``(x [batch, length, dim], mask [batch, length] bool)`` the body uses.

    * Today's ``(x, mask)``: a second positional argument of rank <= 2 is the
      ``[batch, length]`` mask (True for real tokens), as it always was.
    * ``flax`` ``MultiHeadAttention``'s ``(inputs_q, inputs_k=None, inputs_v=None, *,
      mask=None)``: ``mask`` broadcastable to ``[batch, heads, q, k]`` (rank 2 is read as
      today's ``[batch, length]``). A key-padding mask (``[batch, 1, 1, k]``, or any mask
      constant along heads and queries) is honoured; a pair mask is refused. ``inputs_k``
      / ``inputs_v`` must be ``inputs_q`` itself (or omitted): these mechanisms attend a
      sequence to itself, so cross-attention is refused (the mechanisms of
      :data:`CROSS_ATTENTION` take :func:`cross_attention_call` instead).

    ``mask=None``: every position is real. Every refusal is a ValueError of one line,
    raised before anything is traced; :func:`check_call` runs last.
    """
    name = _name(module)
    check_fields(module)
    if any(
        other is not None and getattr(other, "ndim", 3) > 2 and other is not inputs_q
        for other in (inputs_k, inputs_v)
    ):
        shapes = [tuple(getattr(a, "shape", ())) for a in (inputs_q, inputs_k, inputs_v)]
        raise ValueError(
            f"{name} attends a sequence to itself: inputs_k and inputs_v must be inputs_q "
            f"or omitted; cross-attention (shapes q, k, v = {shapes}) is supported by "
            f"{', '.join(CROSS_ATTENTION)} only"
        )
    x, _, _, mask = _read_call(module, inputs_q, inputs_k, inputs_v, mask)
    check_inputs(x, mask)
    return x, mask


def cross_attention_call(
    module: nn.Module,
    inputs_q: Array,
    inputs_k: Array | None = None,
    inputs_v: Array | None = None,
    mask: Array | None = None,
) -> tuple[Array, Array, Array, Array, Array]:
    """The first line of a mechanism that attends one sequence to another: both call
    conventions (as :func:`attention_call`) ->
    ``(x_q [B, q, dim], x_k [B, k, dim_k], x_v [B, k, dim_v], key_mask [B, k],
    query_mask [B, q])``, bool masks.

    ``inputs_k`` defaults to ``inputs_q`` and ``inputs_v`` to ``inputs_k`` (flax's rule).
    ``mask``: ``[batch, k]`` (today's ``[batch, length]`` when attending to itself), or
    broadcastable to ``[batch, heads, q, k]`` and constant along heads and queries (a
    key-padding mask; a pair mask is refused). ``query_mask`` says which queries count as
    real in the statistics: the key mask itself when keys and values are the queries'
    own sequence, all True otherwise (a key-padding mask says nothing of the queries).
    """
    x_q, x_k, x_v, key_mask = _read_call(module, inputs_q, inputs_k, inputs_v, mask)
    if x_k is x_q and x_v is x_q:
        query_mask = key_mask
    else:
        query_mask = jnp.ones(x_q.shape[:2], jnp.bool_)
    return x_q, x_k, x_v, key_mask, query_mask


def check_positive(name: str, value: int) -> None:
    """Raise a ValueError naming ``model.attention_options.<name>`` unless value >= 1."""
    if value < 1:
        raise ValueError(f"model.attention_options.{name} must be >= 1, got {value}")


def compute_dtype(dtype: Any) -> Any:
    """The dtype for the mechanisms' numerics: ``dtype`` promoted to at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def project_qkv(
    x: Array,
    num_heads: int,
    head_dim: int,
    dtype: Any,
    x_k: Array | None = None,
    x_v: Array | None = None,
) -> tuple[Array, Array, Array]:
    """Per-head projections, called inside a compact ``__call__``.

    x [batch, length, dim] -> (q, k, v), each [batch, length, num_heads, head_dim], made by
    submodules named ``query``, ``key`` and ``value`` of the calling module. With ``x_k``
    / ``x_v`` (cross-attention: [batch, k, dim]) keys and values are projected from them.
    """
    q = head_dense(num_heads, head_dim, dtype, "query")(x)
    k = head_dense(num_heads, head_dim, dtype, "key")(x if x_k is None else x_k)
    v = head_dense(num_heads, head_dim, dtype, "value")(x if x_v is None else x_v)
    return q, k, v


def project_out(y: Array, out_dim: int, dtype: Any) -> Array:
    """Output projection, called inside a compact ``__call__``.

    y [batch, length, heads, head_dim] -> [batch, length, out_dim] (submodule ``out``).
    """
    return out_dense(out_dim, dtype)(y.astype(dtype))


def masked_softmax(logits: Array, mask: Array, axis: int = -1) -> Array:
    """Softmax of ``logits`` over ``axis`` where ``mask`` (broadcastable) is True.

    Masked entries are exactly 0. A row with nothing allowed comes out uniform (finite,
    never NaN); callers only feed such rows to outputs that are discarded.
    """
    logits = jnp.where(mask, logits, jnp.asarray(MASKED_LOGIT, logits.dtype))
    return jax.nn.softmax(logits, axis=axis)


def dropout_weights(module: nn.Module, weights: Array, rate: float, deterministic: bool) -> Array:
    """Inverted dropout on attention weights with the module's ``dropout`` rng stream."""
    if deterministic or rate <= 0.0:
        return weights
    if rate >= 1.0:
        raise ValueError(f"attention_dropout must be < 1, got {rate}")
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, weights.shape)
    return jnp.where(keep, weights / (1.0 - rate), jnp.zeros_like(weights))
