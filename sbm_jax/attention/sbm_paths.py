"""The SBM core's static options and the path choice made from them before tracing.

:class:`SBMOptions` is what the core (:func:`sbm_jax.attention.sbm.sbm_attention_core`)
is compiled for: one frozen, hashable object, the core's one static argument.
``SBMAttention`` builds it from its fields (``SBMAttention.core_options``) and checks it
(:meth:`SBMOptions.validate`); the core builds it from its keyword arguments.

From it and a batch's shape, each path of the core chooses statically what it compiles:
:func:`plan_paths` (the capacity buckets under one ``lax.switch`` and the dense branch),
:func:`plan_stream` (``impl="streamed"``: blocks of query rows and their buffers) and
:func:`plan_fused` (``kernel="fused"``: the native kernel and the dense path);
:func:`choose_paths` is the choice a batch gets, what a config check runs. Each raises a
ValueError naming the fields, before anything is compiled, when no path fits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sbm_jax.attention._projections import check_int
from sbm_jax.fastrg import check_law
from sbm_jax.kernels import KERNELS
from sbm_jax.kernels.cost import resolve_kernel, sparse_buckets_worth_it
from sbm_jax.kernels.pairs import DEFAULT_PAIR_PROBES
from sbm_jax.kernels.streamed import block_capacities, default_stream_rows
from sbm_jax.ste import check_ste

IMPLS = ("auto", "sparse", "dense", "streamed")

#: ``max_dense_elements``' default: no limit. The dense path is streamed over query
#: blocks (O(n d) memory per graph, whatever ``batch*heads*n*m``), so only its O(n m)
#: compute grows; ruling it out loses the draws above the largest bucket. (The old
#: default, 2**31, came from when the dense path held ``[B, H, n, m]`` arrays, and cut
#: the dense path from paper presets such as LRA Text, 128 x 2 x 3072^2 pairs, which
#: then dropped most of their edges.)
NO_DENSE_LIMIT = 2**62
#: Edge kernels the sparse branches can use (``SBMAttention.kernel``); ``"fused"`` is the
#: CPU kernel that samples and attends in one native call (:mod:`sbm_jax.kernels.fused`,
#: no capacity buckets); ``"auto"`` is resolved per backend by
#: :func:`sbm_jax.kernels.cost.resolve_kernel`.
EDGE_KERNELS = ("segment", *KERNELS, "fused", "auto")


@dataclasses.dataclass(frozen=True)
class SBMOptions:
    """The static options of the SBM core, one hashable object (``jax.jit``'s static
    argument: each distinct value compiles once).

    The fields are ``SBMAttention``'s of the same names (its docstring says what each
    does), but for ``law`` (the module's ``edge_law``) and ``dropout_rate`` (the rate the
    core applies: the module's ``attention_dropout`` in training, 0 at evaluation). The
    defaults are the core's; the module's own defaults differ for ``dense_below`` and
    ``kernel``. Built with other values than plain ones (a list of buckets, NumPy
    integers, ``kernel="auto"``), it is checked by :meth:`validate` and made hashable by
    :meth:`resolved`.
    """

    law: str = "bernoulli"
    capacity_buckets: tuple[float, ...] = (1 / 64, 1 / 16, 1 / 4)
    impl: str = "auto"
    self_loops: bool = False
    window: int = 0
    dense_below: int = 0
    edge_cost: float | None = None
    max_dense_elements: int = NO_DENSE_LIMIT
    max_edge_slots: int = 2**26
    dropout_rate: float = 0.0
    kernel: str = "rows"
    ste: str = "paper"
    pair_probes: int = DEFAULT_PAIR_PROBES
    stream_rows: int = 0
    stream_slots: int = 0
    edge_cache: int = 0

    def validate(self) -> None:
        """Raise a ValueError naming the bad field as ``SBMAttention`` (and a config's
        ``model.attention_options``) names it; runs before anything is traced."""
        check_int("pair_probes", self.pair_probes)
        check_law(self.law, "edge_law")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not one of {IMPLS}")
        if isinstance(self.capacity_buckets, str):
            raise ValueError(
                f"capacity_buckets must be a tuple of numbers, got {self.capacity_buckets!r}"
            )
        buckets = tuple(self.capacity_buckets)
        bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, numbers.Real)]
        if bad:
            raise ValueError(f"capacity_buckets must be numbers (fractions of n*m), got {bad}")
        if not buckets:
            raise ValueError("capacity_buckets must name at least one fraction of n*m")
        if any(not 0.0 < f <= 1.0 for f in buckets):
            raise ValueError(f"capacity_buckets must lie in (0, 1], got {buckets}")
        if any(b <= a for a, b in zip(buckets, buckets[1:], strict=False)):
            raise ValueError(f"capacity_buckets must be strictly increasing, got {buckets}")
        if self.edge_cost is not None and not self.edge_cost > 0:
            raise ValueError(f"edge_cost must be > 0 (or None), got {self.edge_cost}")
        if self.kernel not in EDGE_KERNELS:
            raise ValueError(f"kernel={self.kernel!r} is not one of {EDGE_KERNELS}")
        resolve_kernel(self.kernel)  # a GPU-only kernel on another backend: one line
        check_ste(self.ste, "ste")
        for field in (
            "window",
            "max_dense_elements",
            "max_edge_slots",
            "dense_below",
            "stream_rows",
            "stream_slots",
            "edge_cache",
        ):
            check_int(field, getattr(self, field), minimum=0)
        if 0 < self.stream_slots < self.stream_rows:
            raise ValueError(
                f"stream_slots={self.stream_slots} is too small for a block of "
                f"stream_rows={self.stream_rows} query rows: it must hold at least one draw "
                "per row, or every block would run dense"
            )

    def resolved(self) -> SBMOptions:
        """The options the core compiles: the law and the estimator checked (one line
        naming ``law`` or ``ste``), ``kernel="auto"`` resolved for the default backend (a
        kernel that cannot run there refused), and every value a plain tuple, bool, int
        or float, so that equal options hash equal."""
        check_law(self.law)
        check_ste(self.ste)
        return dataclasses.replace(
            self,
            capacity_buckets=tuple(float(c) for c in self.capacity_buckets),
            self_loops=bool(self.self_loops),
            window=int(self.window),
            dense_below=int(self.dense_below),
            edge_cost=None if self.edge_cost is None else float(self.edge_cost),
            max_dense_elements=int(self.max_dense_elements),
            max_edge_slots=int(self.max_edge_slots),
            dropout_rate=float(self.dropout_rate),
            kernel=resolve_kernel(self.kernel),
            pair_probes=int(self.pair_probes),
            stream_rows=int(self.stream_rows),
            stream_slots=int(self.stream_slots),
            edge_cache=int(self.edge_cache),
        )

    @property
    def fused(self) -> bool:
        """Whether the fused CPU kernel samples and attends (no capacity buckets):
        ``kernel="fused"`` with ``impl`` ``"auto"`` or ``"sparse"``."""
        return self.kernel == "fused" and self.impl in ("auto", "sparse")

    def forced_half(self, length: int) -> int | None:
        """:func:`forced_half_width` of these options for a sequence of ``length``."""
        return forced_half_width(self.self_loops, self.window, length)

    def forced_per_row(self, length: int) -> int:
        """Forced edges per query row (the slots each sparse branch adds for them)."""
        half = self.forced_half(length)
        return 0 if half is None else 2 * half + 1


def forced_half_width(self_loops: bool, window: int, length: int) -> int | None:
    """Forced edges are the real pairs with ``|i - j| <= half``; None when there are none.

    A window wider than the sequence forces every pair: ``half`` is capped at
    ``length - 1``, so the forced slots per row (``2 half + 1``) never exceed what a row
    can hold twice over (a larger window asked for memory for pairs that cannot exist)."""
    if window > 0:
        return min(window // 2, max(length - 1, 0))
    return 0 if self_loops else None


def bucket_capacities(fractions: Sequence[float], n: int, m: int) -> tuple[int, ...]:
    """Static slot counts ``ceil(f * n * m)`` for each capacity fraction ``f``."""
    return tuple(max(1, math.ceil(f * n * m)) for f in fractions)


def choose_bucket(
    counts: jax.Array, capacities: Sequence[int], force_dense: jax.Array | bool = False
) -> jax.Array:
    """Index of the smallest capacity that holds ``max(counts)``; ``len(capacities)``
    (the dense path) when none does or when ``force_dense``. One scalar for the batch."""
    caps = jnp.asarray(capacities, jnp.int32)
    idx = jnp.sum(caps < jnp.max(counts)).astype(jnp.int32)
    return jnp.where(force_dense, len(capacities), idx)


def plan_paths(
    options: SBMOptions, *, batch: int, heads: int, length: int, backend: str | None = None
) -> tuple[tuple[int, ...], bool]:
    """Static path choice: ``(sparse capacities compiled, dense branch compiled)``.

    ``impl="dense"`` compiles the dense branch only; ``"sparse"`` every bucket (and the
    dense branch above them); ``"auto"`` also drops the buckets the cost model
    (:func:`sbm_jax.kernels.cost.sparse_buckets_worth_it` for ``options.kernel`` on
    ``backend``, ``edge_cost`` overriding its calibration) says cost more than the dense
    branch, and runs sequences with ``n*m <= dense_below`` dense. The dense branch is
    compiled only when ``batch*heads*n*m <= max_dense_elements``; a sparse bucket only
    when its slots over the batch, ``batch*heads*(capacity + forced edges per row * n)``,
    are at most ``max_edge_slots`` (a lax.switch reserves its largest branch's memory,
    ~20-30 bytes per slot) and ``n*m`` fits the int32 edge keys.

    Raises a ValueError naming the fields and the sizes they would need, before anything
    is compiled, when no path is left.
    """
    o = options
    n = m = length
    forced_per_row = o.forced_per_row(length)
    pairs = batch * heads * n * m
    dense_allowed = pairs <= o.max_dense_elements
    dense_hint = (
        f"max_dense_elements={o.max_dense_elements} rules out the dense path, which needs "
        f"max_dense_elements >= batch*heads*n*m = {pairs}"
    )
    if o.impl == "dense":
        if not dense_allowed:
            raise ValueError(f"impl='dense': {dense_hint}; raise it, or use impl='auto'")
        return (), True
    if n * m >= 2**31 - 1:  # sparse edge keys row * m + col are int32
        if not dense_allowed:
            raise ValueError(
                f"length={length}: the sparse buckets' int32 edge keys need n*m < 2**31 - 1 "
                f"(n*m = {n * m}), and {dense_hint}: raise max_dense_elements or shorten "
                "the sequence"
            )
        return (), True
    all_caps = bucket_capacities(o.capacity_buckets, n, m)
    caps = tuple(
        c for c in all_caps if batch * heads * (c + forced_per_row * n) <= o.max_edge_slots
    )
    if not caps and not dense_allowed:
        need = batch * heads * (all_caps[0] + forced_per_row * n)
        raise ValueError(
            f"no path fits batch={batch}, length={length}: the smallest sparse bucket "
            f"(capacity_buckets[0]={o.capacity_buckets[0]}) needs batch*heads*slots = {need} "
            f"slots, over max_edge_slots={o.max_edge_slots}, and {dense_hint}; raise "
            "max_edge_slots or max_dense_elements, or lower the batch or the length"
        )
    if o.impl == "auto" and dense_allowed:
        if n * m <= o.dense_below:
            return (), True
        # a branch holds its bucket's slots plus the forced (window, self-loop) edges of
        # every row; the dense branch gets those for free in its mask
        worth = sparse_buckets_worth_it(
            tuple(c + forced_per_row * n for c in caps),
            n,
            m,
            kernel=o.kernel,
            backend=backend,
            slot_cost=o.edge_cost,
        )
        caps = tuple(c for c, ok in zip(caps, worth, strict=True) if ok)
    return caps, dense_allowed


def plan_stream(
    options: SBMOptions, *, batch: int, heads: int, length: int, backend: str | None = None
) -> tuple[int, tuple[int, ...], bool]:
    """Static plan of ``impl="streamed"``: ``(block rows, per-block buffers, dense blocks)``.

    ``stream_rows`` query rows per block (0: :func:`default_stream_rows`, ``bq * m``
    near 2^20); the buffers are ``capacity_buckets``' fractions of a block's ``bq * m``
    pairs, or the one buffer ``stream_slots`` when it is set, less those over
    ``max_edge_slots`` or (with the cost model of the ``rows`` kernel, or ``triton``'s,
    ``edge_cost`` overriding its calibration) dearer than the dense path on the block's
    rows. A block whose draws exceed the largest buffer runs dense, unless
    ``batch*heads*n*m > max_dense_elements`` rules the dense path out (then those draws
    are lost and ``overflow`` says so).

    Raises a ValueError naming the field, before anything is compiled, when
    ``stream_slots`` cannot hold one draw per row of a block (every block would run
    dense) or when no path is left.
    """
    o = options
    n = m = length
    forced_per_row = o.forced_per_row(length)
    # The streamed blocks attend with the rows kernel (or its Triton form on a GPU).
    kernel = "rows" if o.kernel in ("segment", "fused") else o.kernel
    bq = default_stream_rows(n, m) if o.stream_rows == 0 else int(o.stream_rows)
    bq = min(bq, max(1, n))
    if bq * m >= 2**31 - 1:
        raise ValueError(
            f"stream_rows={o.stream_rows}: a block's int32 edge keys need rows * length < "
            f"2**31 - 1 (here {bq} * {m}); lower stream_rows"
        )
    caps: tuple[int, ...]
    if o.stream_slots:
        if o.stream_slots < bq:
            raise ValueError(
                f"stream_slots={o.stream_slots} is too small for a block of {bq} query rows "
                f"(stream_rows={o.stream_rows}, 0 = automatic): it must hold at least one "
                "draw per row, or every block would run dense"
            )
        caps = (int(o.stream_slots),)
    else:
        caps = block_capacities(o.capacity_buckets, bq, m)
    dense_allowed = batch * heads * n * m <= o.max_dense_elements
    caps = tuple(c for c in caps if c + forced_per_row * bq <= o.max_edge_slots)
    if dense_allowed:
        worth = sparse_buckets_worth_it(
            tuple(c + forced_per_row * bq for c in caps),
            bq,
            m,
            kernel=kernel,
            backend=backend,
            slot_cost=o.edge_cost,
        )
        caps = tuple(c for c, ok in zip(caps, worth, strict=True) if ok)
    if not caps and not dense_allowed:
        raise ValueError(
            f"impl='streamed': no block buffer fits max_edge_slots={o.max_edge_slots} and "
            f"max_dense_elements={o.max_dense_elements} rules out the dense blocks "
            f"(batch*heads*n*m = {batch * heads * n * m}); raise one of them"
        )
    return bq, caps, dense_allowed


def plan_fused(options: SBMOptions, *, batch: int, heads: int, length: int) -> tuple[bool, bool]:
    """Static plan of ``kernel="fused"``: ``(fused kernel compiled, dense path compiled)``.

    The dense path alone for ``impl="auto"`` and ``n*m <= dense_below``; with
    ``impl="auto"`` otherwise both, the batch choosing one on device where the cost model
    (:mod:`sbm_jax.kernels.cost`, ``edge_cost`` overriding it) says its draws cost more
    than the dense path (a batch near density 1 costs the kernel ``n m`` pair tests and
    an edge's attention each; the dense path is matrix products), unless
    ``batch*heads*n*m > max_dense_elements`` rules the dense path out; with
    ``impl="sparse"`` the kernel alone. The kernel has no capacity (no draw is ever lost)
    and draws a row whose bernoulli bound is too close to 1 pair by pair itself.
    """
    n = m = length
    dense_allowed = batch * heads * n * m <= options.max_dense_elements
    if options.impl == "auto" and dense_allowed and n * m <= options.dense_below:
        return False, True
    return True, dense_allowed and options.impl == "auto"


def choose_paths(
    options: SBMOptions, *, batch: int, heads: int, length: int
) -> tuple[tuple[int, ...], bool]:
    """The static choice the core makes for a ``[batch, length]`` input with ``heads``
    heads: ``(sparse capacities compiled, dense path compiled)`` (a ValueError naming the
    fields when no path fits). With ``impl="streamed"`` the capacities are
    :func:`plan_stream`'s per-block buffers and the flag whether blocks may run dense;
    with the fused kernel there are no capacities (:func:`plan_fused`)."""
    if options.fused:
        return (), plan_fused(options, batch=batch, heads=heads, length=length)[1]
    if options.impl == "streamed":
        _, caps, dense = plan_stream(options, batch=batch, heads=heads, length=length)
        return caps, dense
    return plan_paths(options, batch=batch, heads=heads, length=length)
