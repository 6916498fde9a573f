"""Shared helpers for the attention-mechanism tests: inputs, numpy references, checks.

Two input setups are used across the tests:
- ``make_inputs``: B=3 examples of length N=7 with real lengths LENGTHS = (7, 4, 1) and
  width DIM=6, for modules built with HEADS=2, HEAD_DIM=4, OUT=5 (``build_module``).
- ``module_inputs``: 2 examples of length 12 with real lengths (12, 7) and width 8.

The numpy references work in float64 from the module's own projection parameters
(``dense_qkv``, ``dense_out``), so they are independent of the code under test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

B, N, DIM, HEADS, HEAD_DIM, OUT = 3, 7, 6, 2, 4, 5
LENGTHS = np.array([7, 4, 1])


# ---------------------------------------------------------------------------------------
# Inputs and modules.


def token_mask(n: int, lengths) -> jax.Array:
    """[len(lengths), n] bool: True at the first lengths[b] positions of example b."""
    return jnp.arange(n)[None, :] < jnp.asarray(lengths)[:, None]


def make_inputs(
    seed: int = 0,
    length: int = N,
    scale: float = 1.0,
    *,
    batch: int = B,
    dim: int = DIM,
    lengths=LENGTHS,
) -> tuple[jax.Array, jax.Array]:
    """x [batch, length, dim] ~ scale * N(0, 1) from key(seed); mask [batch, length] with
    real lengths min(lengths, length)."""
    x = scale * jax.random.normal(jax.random.key(seed), (batch, length, dim))
    return x, token_mask(length, np.minimum(lengths, length))


def module_inputs(seed: int, n: int = 12, lengths=(12, 7)) -> tuple[jax.Array, jax.Array]:
    """x [2, n, 8] from key(seed) and its mask [2, n]."""
    return make_inputs(seed, n, batch=2, dim=8, lengths=lengths)


def build_module(name: str, **options):
    """Registered mechanism `name` with HEADS, HEAD_DIM, OUT and the given options."""
    from sbm_jax.attention import build_attention

    return build_attention(name, options=options, num_heads=HEADS, head_dim=HEAD_DIM, out_dim=OUT)


def init(module, x, mask):
    """Variables of `module` from key(1), deterministic (plain arrays: the logical axis
    names the mechanisms declare are unboxed)."""
    # jitted: run op by op, an init compiles each of its operations as its own program
    return jax.jit(
        lambda x, mask: nn.unbox(module.init(jax.random.key(1), x, mask, deterministic=True))
    )(x, mask)


def jit_apply(module, params, x, mask):
    """``module.apply(params, x, mask, deterministic=True)`` as one compiled program."""
    return jax.jit(lambda p, x, m: module.apply(p, x, m, deterministic=True))(params, x, mask)


# ---------------------------------------------------------------------------------------
# Numpy references.


def to64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def dense_qkv(params, x, names: Sequence[str] = ("query", "key", "value")) -> tuple:
    """Projections [B, n, H, d] in float64 from the module's DenseGeneral parameters."""
    p = to64(params["params"])
    x = np.asarray(x, np.float64)
    return tuple(
        np.einsum("bnc,chd->bnhd", x, p[name]["kernel"]) + p[name]["bias"] for name in names
    )


def dense_out(params, y, bias: bool = True) -> np.ndarray:
    """Output projection of y [B, n, H, d] -> [B, n, out] in float64."""
    p = to64(params["params"])
    out = np.einsum("bnhd,hdo->bno", y, p["out"]["kernel"])
    return out + p["out"]["bias"] if bias else out


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def softmax_attention(q, k, v, mask=None) -> np.ndarray:
    """Vectorised softmax attention q [B,n,H,d], k [B,m,H,d], v [B,m,H,e] -> [B,n,H,e],
    logits scaled by 1/sqrt(d); keys where mask [B, m] is False are removed."""
    logits = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(np.asarray(mask)[:, None, None, :], logits, -np.inf)
    return np.einsum("bhij,bjhd->bihd", softmax(logits), v)


def dense_masked_attention(q, k, v, allowed) -> np.ndarray:
    """Row-by-row softmax attention; q [B,n,H,d], k [B,m,H,d], v [B,m,H,e], allowed
    broadcastable to [B,H,n,m]; rows without an allowed key give 0."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    batch, n, heads, d = q.shape
    allowed = np.broadcast_to(np.asarray(allowed), (batch, heads, n, k.shape[1]))
    out = np.zeros((batch, n, heads, v.shape[-1]))
    for bi in range(batch):
        for h in range(heads):
            for i in range(n):
                keys = np.nonzero(allowed[bi, h, i])[0]
                if keys.size == 0:
                    continue
                s = k[bi, keys, h] @ q[bi, i, h] / math.sqrt(d)
                w = np.exp(s - s.max())
                out[bi, i, h] = (w / w.sum()) @ v[bi, keys, h]
    return out


def tt_dense_by_loops(cores) -> np.ndarray:
    """Full weight from TT cores [R, I, J, R'], entry by entry from the definition
    (row-major multi-indices; independent of any einsum index order)."""
    cores = [np.asarray(c, np.float64) for c in cores]
    in_modes = [c.shape[1] for c in cores]
    out_modes = [c.shape[2] for c in cores]
    w = np.zeros((math.prod(in_modes), math.prod(out_modes)))
    for row, i_idx in enumerate(np.ndindex(*in_modes)):
        for col, j_idx in enumerate(np.ndindex(*out_modes)):
            prod = np.ones((1, 1))
            for core, i, j in zip(cores, i_idx, j_idx, strict=True):
                prod = prod @ core[:, i, j, :]
            w[row, col] = prod[0, 0]
    return w


# ---------------------------------------------------------------------------------------
# Checks shared by the mechanisms.


def assert_padding_invariant(apply_fn: Callable, x, mask, noise) -> jax.Array:
    """Replaces the padded positions of x [B, n, D] by noise [B, n, D]; apply_fn(x) must
    give bitwise the same output at real positions. Returns apply_fn(x)."""
    y = apply_fn(x)
    y2 = apply_fn(jnp.where(mask[..., None], x, noise))
    real = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y)[real], np.asarray(y2)[real])
    return y


def masked_grads_are_finite(apply_fn: Callable, params, x, mask) -> Any:
    """Jitted gradients w.r.t. (params, x) of sum over real tokens of apply_fn(params, x)^2;
    asserts every leaf finite and returns (param_grads, x_grads)."""

    def loss(params, x):
        y = apply_fn(params, x)
        return jnp.sum(jnp.where(mask[..., None], y, 0.0) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))
    return grads


def count_compiles(fn: Callable[[], Any]) -> int:
    """How many programs the backend compiles while ``fn()`` runs (its result blocked on)."""
    from jax._src import dispatch, monitoring

    compiles = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(fn())
    finally:
        monitoring.unregister_event_duration_listener(listen)
    return len(compiles)


def assert_traced_once(fn: Callable, calls: Iterable[tuple]) -> None:
    """``fn`` compiles once for every argument tuple in ``calls`` (same shapes, other
    data): ``jax.jit(fn)`` traces once, and ``fn`` called as it is (eagerly, as a
    notebook or ``model.init`` calls a layer) compiles no more for a call on other data
    than for the first call repeated.

    The second half is what can fail: ``jit``'s cache alone guarantees one trace for
    calls of identical shapes, but a path chosen on the host from the data (a static
    argument of an inner ``jax.jit``, taken only when the values are concrete) compiles
    once per path when called eagerly, and only there."""
    calls = list(calls)
    traces = []

    @jax.jit
    def traced(*args):
        traces.append(None)
        return fn(*args)

    for args in calls:
        jax.block_until_ready(traced(*args))
    assert len(traces) == 1
    jax.block_until_ready(fn(*calls[0]))  # compiles every operation once
    # What a call compiles even on the same data (an eager lax loop traces its body
    # anew), against what a call on other data compiles: more is a path per batch.
    again = count_compiles(lambda: fn(*calls[0]))
    for i, args in enumerate(calls[1:], 1):
        n = count_compiles(lambda args=args: fn(*args))
        assert n == again, f"call {i} (other data) compiled {n} programs, a repeated call {again}"


def assert_module_ignores_padding(module) -> jax.Array:
    """On make_inputs() with padded positions replaced by 100 * N(0, 1) noise from key(7),
    the module's deterministic outputs at real positions are bitwise unchanged.
    Returns the output on the clean inputs."""
    x, mask = make_inputs()
    params = init(module, x, mask)
    noise = 100.0 * jax.random.normal(jax.random.key(7), x.shape)
    return assert_padding_invariant(
        jax.jit(lambda x: module.apply(params, x, mask, deterministic=True)), x, mask, noise
    )


def module_grads_with_fully_padded_row(module, *, deterministic: bool = True, rngs=None) -> Any:
    """masked_grads_are_finite of `module` on make_inputs() with example 2 fully padded
    (no real token); returns (param_grads, x_grads)."""
    x, mask = make_inputs()
    mask = jnp.asarray(np.asarray(mask) & (np.arange(B) != 2)[:, None])  # example 2: no token
    params = init(module, x, mask)

    def apply(params, x):
        return module.apply(params, x, mask, deterministic=deterministic, rngs=rngs)

    return masked_grads_are_finite(apply, params, x, mask)


def assert_no_retracing_across_batches(module, rng_stream: str | None = None) -> None:
    """The jitted deterministic apply of `module` on three batches make_inputs(seed) with the
    mask's rows rolled by seed traces once; with rng_stream, key(seed) feeds that stream."""
    x, mask = make_inputs()
    params = init(module, x, mask)

    def forward(params, x, mask, *key):
        rngs = {rng_stream: key[0]} if rng_stream else None
        return module.apply(params, x, mask, deterministic=True, rngs=rngs)

    def calls():
        for seed in range(3):
            xs, _ = make_inputs(seed)
            key = (jax.random.key(seed),) if rng_stream else ()
            yield (params, xs, jnp.roll(mask, seed, axis=0), *key)

    assert_traced_once(forward, calls())


def assert_grads_finite_and_traced_once(
    apply_fn: Callable, params, x_shape, has_aux: bool = False
) -> Any:
    """Jitted gradients of sum(y^2), y = apply_fn(params, x, rng) (or (y, aux) when has_aux),
    on two fresh batches x ~ N(0, 1) from key(10 + seed) with rng = key(seed): finite and
    traced once. Returns the last aux (None without has_aux)."""
    traces = []

    def loss(params, x, rng):
        traces.append(1)
        out = apply_fn(params, x, rng)
        y, aux = out if has_aux else (out, None)
        return jnp.sum(y**2), aux

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    aux = None
    for seed in range(2):
        xb = jax.random.normal(jax.random.key(10 + seed), x_shape)
        (gp, gx), aux = grad_fn(params, xb, jax.random.key(seed))
        assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(gp))
        assert np.isfinite(np.asarray(gx)).all()
    assert len(traces) == 1  # traced once, not once per batch
    return aux
