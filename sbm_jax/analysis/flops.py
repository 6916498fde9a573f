"""Parameter counts and analytic per-example FLOPs of every attention mechanism.

Both come from the mechanism's registry entry (``sbm_jax.attention.registry.Mechanism``):
its ``params`` and ``flops`` functions live next to its module, with the per-operation
formulas in their docstrings, and its option defaults are its module's fields. A test
checks every analytic parameter count against a real ``init``. FLOPs are counted by hand,
per operation, for ONE example (batch 1) of length ``n`` with no padding, for the
attention layer only (its own projections included; the encoder's MLP and LayerNorms
are not). Conventions:

* a multiply-add is 2 FLOPs, so a ``[a, b] @ [b, c]`` product costs ``2abc``;
* every elementwise op (add, multiply, divide, exp, max, relu, sigmoid, elu) costs 1;
  a softmax over a row costs 5 per entry (max, subtract, exp, sum, divide);
* costs that do not depend on the example (drawing Performer's random features, SBM's
  block matrix ``S``, the damping graph of TSA) are included once, as if the batch held
  one example: they are an upper bound of the per-example share;
* sorting (Reformer) is counted as ``n log2 n`` comparisons per hash round;
* index bookkeeping (gathers, scatters, masks, reshapes) costs 0.

Symbols: ``n`` length, ``D`` model width (``emb_dim``), ``H`` heads, ``d`` head width;
every per-head cost is multiplied by ``H``. All mechanisms but TSA pay the per-head
projections ``qkv_projection = 3 * 2nDHd`` (Reformer: 2, shared QK) and
``out_projection = 2nHdD`` (``sbm_jax.attention.counting``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sbm_jax.attention import available, get_mechanism
from sbm_jax.attention.counting import SOFTMAX
from sbm_jax.attention.sparse_patterns import default_stride, pattern_edges

__all__ = [
    "LRA_SEQ_LENS",
    "SOFTMAX",
    "attention_flops",
    "attention_param_count",
    "counted_mechanisms",
    "default_stride",
    "flops_table",
    "pattern_edges",
]


def _check_shape(seq_len: int, emb_dim: int, num_heads: int, head_dim: int) -> None:
    for field, value in (
        ("seq_len", seq_len),
        ("emb_dim", emb_dim),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field}={value!r} must be a positive integer")


def attention_param_count(
    name: str,
    *,
    emb_dim: int,
    num_heads: int,
    head_dim: int,
    seq_len: int,
    options: Mapping[str, Any] | None = None,
) -> int:
    """Parameters of one attention layer on inputs ``[*, seq_len, emb_dim]``.

    Analytic (the mechanism's registered ``params``); ``seq_len`` matters for mechanisms
    that own sequence-length-sized parameters only through their options (Linformer's
    ``max_len``).
    """
    _check_shape(seq_len, emb_dim, num_heads, head_dim)
    mechanism = get_mechanism(name, field="mechanism")
    if mechanism.params is None:
        raise ValueError(f"mechanism={name!r} is registered but has no parameter count")
    o = mechanism.resolve_options(options, field="options")
    return int(mechanism.params(seq_len, emb_dim, num_heads, head_dim, o))


def counted_mechanisms() -> list[str]:
    """Registered mechanisms with a FLOP formula (every built-in one)."""
    return [name for name in available() if get_mechanism(name).flops is not None]


def attention_flops(
    name: str,
    *,
    seq_len: int,
    emb_dim: int,
    num_heads: int,
    head_dim: int,
    options: Mapping[str, Any] | None = None,
    density: float | None = None,
) -> dict[str, float]:
    """Analytic FLOPs of one attention layer on one example, per operation plus ``total``.

    Args:
      name: registry name of the mechanism.
      seq_len, emb_dim, num_heads, head_dim: n, D, H, d.
      options: the mechanism's options (its defaults fill the rest).
      density: SBM's fraction of the n^2 pairs sampled (None: 1.0, the dense bound);
        ignored by the other mechanisms.

    Returns:
      ``{op: flops}`` for the ops of the mechanism's ``flops`` docstring, with the
      projections (``qkv_projection``, ``out_projection``) and ``total`` (their sum).
    """
    _check_shape(seq_len, emb_dim, num_heads, head_dim)
    mechanism = get_mechanism(name, field="mechanism")  # unknown names: the registry's message
    if mechanism.flops is None:
        raise ValueError(
            f"mechanism={name!r} is registered but has no FLOP formula; "
            f"counted: {counted_mechanisms()}"
        )
    if density is not None and not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density={density!r} must lie in [0, 1]")
    o = mechanism.resolve_options(options, field="options")
    costs = mechanism.flops(seq_len, emb_dim, num_heads, head_dim, o, density)
    costs = {k: float(v) for k, v in costs.items()}
    costs["total"] = float(sum(costs.values()))
    return costs


LRA_SEQ_LENS = (1024, 2048, 4096)


def flops_table(
    mechanisms: Iterable[str] | None = None,
    seq_lens: Iterable[int] = LRA_SEQ_LENS,
    *,
    emb_dim: int = 64,
    num_heads: int = 2,
    head_dim: int = 32,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    densities: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Rows ``{mechanism, seq_len, params, flops, attention_flops, relative_to_full}``.

    Defaults are the LRA shapes of the paper's Table 3 (emb 64, 2 heads of 32).
    ``options`` and ``densities`` are keyed by mechanism; ``attention_flops`` leaves out
    the Q/K/V and output projections; ``relative_to_full`` is total / full's total.
    Options a task sizes to its length (the entry's ``length_options``, e.g. Linformer's
    ``max_len``) default to the row's length.
    """
    names = list(mechanisms) if mechanisms is not None else available()
    options = dict(options or {})
    densities = dict(densities or {})
    rows = []
    for n in seq_lens:
        full_total = attention_flops(
            "full", seq_len=n, emb_dim=emb_dim, num_heads=num_heads, head_dim=head_dim
        )["total"]
        for name in names:
            sized = get_mechanism(name, field="mechanism").length_options
            opts = {**(sized(n) if sized else {}), **dict(options.get(name, {}))}
            shape = dict(emb_dim=emb_dim, num_heads=num_heads, head_dim=head_dim)
            costs = attention_flops(
                name, seq_len=n, options=opts, density=densities.get(name), **shape
            )
            projections = costs["qkv_projection"] + costs["out_projection"]
            rows.append(
                {
                    "mechanism": name,
                    "seq_len": n,
                    "params": attention_param_count(name, seq_len=n, options=opts, **shape),
                    "flops": costs["total"],
                    "attention_flops": costs["total"] - projections,
                    "relative_to_full": costs["total"] / full_total,
                    "density": densities.get(name),
                }
            )
    return rows
