"""Tensor-train (MPO) dense layers (Xu et al. 2021, sec. 4.2; Novikov et al. 2015).

A weight ``W`` of shape ``[I, J]`` with ``I = I_1 ... I_N`` and ``J = J_1 ... J_N`` is
stored as N cores ``G_n`` of shape ``[R_{n-1}, I_n, J_n, R_n]`` with ``R_0 = R_N = 1``:

    W[(i_1..i_N), (j_1..j_N)] = G_1[:, i_1, j_1, :] G_2[:, i_2, j_2, :] ... G_N[:, i_N, j_N, :]

Flat indices follow row-major (C) order, the order ``jnp.reshape`` uses: ``i_1`` varies
slowest. The forward pass contracts the input with one core at a time (paper eq. 4) and
never forms ``W``; ``tt_to_dense`` rebuilds ``W`` for tests and inspection.

Parameters: ``sum_n R_{n-1} I_n J_n R_n`` (``tt_num_params``). In the quantized setting
(QTT: ``I_n = J_n = 2``, ``R_n = 2`` for ``0 < n < N``) that is ``8 + 16 (N - 2) + 8 =
16 (N - 1)`` for ``N >= 2`` (the paper's formula), against ``4^N`` for a dense ``W``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Initializer = Callable[..., Array]


def prime_factors(n: int) -> list[int]:
    """Prime factors of ``n`` in ascending order (``[]`` for 1)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive integer to factorise")
    factors = []
    p = 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors


def tt_modes(in_dim: int, out_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Factorise ``in_dim`` and ``out_dim`` into mode sizes of equal count N.

    Each dimension is split into its prime factors (so a power of two gives all 2s, the
    QTT setting); the shorter list is padded with modes of size 1, which keeps the
    products and only adds a trivial index to those cores. A prime dimension stays one
    mode of its own size.
    """
    if not isinstance(in_dim, int) or in_dim < 1:
        raise ValueError(f"in_dim={in_dim!r} must be a positive integer")
    if not isinstance(out_dim, int) or out_dim < 1:
        raise ValueError(f"out_dim={out_dim!r} must be a positive integer")
    in_modes = prime_factors(in_dim) or [1]
    out_modes = prime_factors(out_dim) or [1]
    n = max(len(in_modes), len(out_modes))
    in_modes += [1] * (n - len(in_modes))
    out_modes += [1] * (n - len(out_modes))
    return tuple(in_modes), tuple(out_modes)


def tt_ranks(num_modes: int, rank: int | Sequence[int]) -> tuple[int, ...]:
    """TT-rank tuple ``(R_0, ..., R_N)`` with ``R_0 = R_N = 1``.

    ``rank`` is either one inner rank used for every ``R_n`` with ``0 < n < N``, or the
    full tuple of length ``N + 1`` (checked to start and end with 1).
    """
    if num_modes < 1:
        raise ValueError(f"num_modes={num_modes!r} must be >= 1")
    if isinstance(rank, int):
        if rank < 1:
            raise ValueError(f"rank={rank!r} must be >= 1")
        return (1,) + (rank,) * (num_modes - 1) + (1,)
    ranks = tuple(int(r) for r in rank)
    if len(ranks) != num_modes + 1:
        raise ValueError(f"rank={ranks} must have num_modes + 1 = {num_modes + 1} entries")
    if ranks[0] != 1 or ranks[-1] != 1:
        raise ValueError(f"rank={ranks} must start and end with 1 (R_0 = R_N = 1)")
    if min(ranks) < 1:
        raise ValueError(f"rank={ranks} entries must be >= 1")
    return ranks


def qtt_shapes(dim: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The paper's QTT setting for a square ``dim x dim`` weight, ``dim = 2^N``, N >= 1.

    Returns ``(in_modes, out_modes, ranks)`` = ``((2,)*N, (2,)*N, (1, 2, ..., 2, 1))``.
    """
    if not isinstance(dim, int) or dim < 2 or dim & (dim - 1):
        raise ValueError(f"dim={dim!r} must be a power of two >= 2 for the QTT setting")
    n = dim.bit_length() - 1
    return (2,) * n, (2,) * n, tt_ranks(n, 2)


def tt_core_shapes(
    in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Shapes ``[R_{n-1}, I_n, J_n, R_n]`` of the N cores, validating the arguments."""
    in_modes, out_modes = tuple(in_modes), tuple(out_modes)
    if len(in_modes) != len(out_modes) or not in_modes:
        raise ValueError(
            f"in_modes={in_modes} and out_modes={out_modes} must be non-empty and of equal length"
        )
    if min(in_modes) < 1 or min(out_modes) < 1:
        raise ValueError(f"in_modes={in_modes} and out_modes={out_modes} must be >= 1")
    ranks = tt_ranks(len(in_modes), tuple(ranks))
    return [(ranks[n], in_modes[n], out_modes[n], ranks[n + 1]) for n in range(len(in_modes))]


def tt_num_params(in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int]) -> int:
    """Number of core parameters: ``sum_n R_{n-1} I_n J_n R_n`` (no bias)."""
    return sum(math.prod(s) for s in tt_core_shapes(in_modes, out_modes, ranks))


def tt_to_dense(cores: Sequence[Array]) -> Array:
    """Rebuild the full weight ``W [prod I_n, prod J_n]`` from cores ``[R, I_n, J_n, R']``.

    Costs ``O(I J R)`` memory: for tests and inspection, not for the forward pass.
    """
    if not cores:
        raise ValueError("cores must hold at least one core")
    first = cores[0]
    if first.ndim != 4 or first.shape[0] != 1:
        raise ValueError(f"cores[0] has shape {first.shape}; expected [1, I_1, J_1, R_1]")
    w = first[0]  # [I_1, J_1, R_1]
    for n, core in enumerate(cores[1:], start=1):
        if core.ndim != 4 or core.shape[0] != w.shape[-1]:
            raise ValueError(
                f"cores[{n}] has shape {core.shape}; expected [{w.shape[-1]}, I_n, J_n, R_n]"
            )
        p_i, p_j, _ = w.shape
        _, i_n, j_n, r_n = core.shape
        w = jnp.einsum("pqr,rijs->piqjs", w, core).reshape(p_i * i_n, p_j * j_n, r_n)
    if w.shape[-1] != 1:
        raise ValueError(f"cores[-1] has last rank {w.shape[-1]}; expected R_N = 1")
    return w[..., 0]


def tt_contract(x: Array, cores: Sequence[Array]) -> Array:
    """``x @ W`` for ``W`` in TT format, one core at a time, without forming ``W``.

    x: [..., prod I_n] -> [..., prod J_n]. Cost per row ``sum_n R_{n-1} I_n J_n R_n
    (prod_{k<n} J_k) (prod_{k>n} I_k)``.
    """
    in_modes = [c.shape[1] for c in cores]
    out_modes = [c.shape[2] for c in cores]
    in_dim = math.prod(in_modes)
    if x.shape[-1] != in_dim:
        raise ValueError(f"x has last dimension {x.shape[-1]}; the TT cores expect {in_dim}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    # t: [A, R_{n-1}, I_n, B_n] with A = rows * prod_{k<n} J_k and B_n = prod_{k>n} I_k.
    t = x.reshape(rows, 1, in_modes[0], in_dim // in_modes[0])
    for n, core in enumerate(cores):
        t = jnp.einsum("arib,rijs->ajsb", t, core)  # [A, J_n, R_n, B_n]
        a, j_n, r_n, b_n = t.shape
        if n + 1 < len(cores):
            i_next = in_modes[n + 1]
            t = t.reshape(a * j_n, r_n, i_next, b_n // i_next)
    return t.reshape(*lead, math.prod(out_modes))


def tt_normal_init(stddev: float) -> Initializer:
    """Normal initializer for one TT core with the given standard deviation."""

    def init(key: Array, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        return stddev * jax.random.normal(key, shape, dtype)

    return init


def tt_core_stddev(in_modes: Sequence[int], ranks: Sequence[int]) -> float:
    """Core stddev s giving the rebuilt ``W`` LeCun-normal variance ``1 / prod I_n``.

    An entry of ``W`` sums ``prod_{0<n<N} R_n`` products of N independent core entries,
    so ``Var W = prod R_n * s^(2N)``; solve for s.
    """
    n = len(in_modes)
    inner = math.prod(ranks[1:-1])
    return (1.0 / (math.prod(in_modes) * inner)) ** (1.0 / (2 * n))


class TTDense(nn.Module):
    """Dense layer whose kernel is a tensor train (MPO); x [..., I] -> [..., features].

    Attributes:
      features: output size J = prod(out_modes).
      rank: inner TT-rank (int) or the full tuple (R_0, ..., R_N).
      in_modes / out_modes: mode sizes; when None they come from ``tt_modes`` (prime
        factors, QTT for powers of two).
      use_bias: add a dense bias of size ``features``.
      dtype: compute dtype (None: the promoted input/param dtype).
      param_dtype: dtype of the cores and bias.
      core_init: initializer for every core; default normal with ``tt_core_stddev``.
    """

    features: int
    rank: int | Sequence[int] = 2
    in_modes: Sequence[int] | None = None
    out_modes: Sequence[int] | None = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    core_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()

    def shapes(self, in_dim: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(in_modes, out_modes, ranks) used for an input of size ``in_dim``."""
        auto_in, auto_out = tt_modes(in_dim, self.features)
        in_modes = tuple(self.in_modes) if self.in_modes is not None else None
        out_modes = tuple(self.out_modes) if self.out_modes is not None else None
        if in_modes is None and out_modes is None:
            in_modes, out_modes = auto_in, auto_out
        elif in_modes is None or out_modes is None:
            raise ValueError("TTDense.in_modes and TTDense.out_modes must be given together")
        if math.prod(in_modes) != in_dim:
            raise ValueError(
                f"TTDense.in_modes={in_modes} multiply to {math.prod(in_modes)}, "
                f"but the input has {in_dim} features"
            )
        if math.prod(out_modes) != self.features:
            raise ValueError(
                f"TTDense.out_modes={out_modes} multiply to {math.prod(out_modes)}, "
                f"but features={self.features}"
            )
        return in_modes, out_modes, tt_ranks(len(in_modes), self.rank)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """x: [..., I] -> [..., features]."""
        in_modes, out_modes, ranks = self.shapes(x.shape[-1])
        init = self.core_init or tt_normal_init(tt_core_stddev(in_modes, ranks))
        cores = [
            self.param(f"core_{n}", init, shape, self.param_dtype)
            for n, shape in enumerate(tt_core_shapes(in_modes, out_modes, ranks))
        ]
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        x, bias, *cores = nn.dtypes.promote_dtype(x, bias, *cores, dtype=self.dtype)
        y = tt_contract(x, cores)
        if bias is not None:
            y = y + bias
        return y


def tt_cores_of(params: dict[str, Any]) -> list[Array]:
    """The cores of one ``TTDense`` parameter dict, in order (``core_0``, ``core_1``...)."""
    n = sum(1 for k in params if k.startswith("core_"))
    if n == 0:
        raise ValueError(f"params has no core_<n> entries; keys are {sorted(params)}")
    return [params[f"core_{i}"] for i in range(n)]
