#!/usr/bin/env python
"""Time and size SBM attention against exact attention, forward + backward.

Every ratio divides by the best exact attention on the backend (:func:`baseline_options`):
``full`` with ``implementation="chunked"`` (exact softmax attention over 512-query blocks
under ``lax.map``, each rematerialised in the backward pass) on CPU and TPU, and
``implementation="cudnn"`` (cuDNN flash attention, bfloat16) on GPU. XLA's naive attention
(``jax.nn.dot_product_attention`` with no implementation, the ``[B, H, n, n]`` scores
materialised) is reported beside it as ``full_xla``.

Measures, in one process (so that ratios are fair on a shared, drifting machine):

* ``layer``: the whole ``SBMAttention`` layer *with the module's defaults* (projections,
  membership MLP, block matrix, plans, path choice, fastRG or the streamed dense path,
  estimator, attention, output projection) in training mode, its parameters shifted so
  that the sampled density is about the case's density, against the exact ``full`` layer
  (same projections), the naive one, and at the ``--peer-sizes`` lengths the ``--peers``
  (Performer, Linformer, Nystromformer, Reformer, local, sparse patterns; module defaults),
  all timed in alternation (shuffled within each round); gradients with respect to all
  parameters and x. Cases ``--layer-cases n:density[:batch]``.
  With ``--layer-processes K`` each case runs instead in K fresh processes of this
  script, one after another, and its figures are the medians over them (the range in
  the note): what ran before in a process (XLA's and the C library's allocator state)
  moves the full layer's time at n=1024 by 20-50% on a 2-core CPU.
* ``long``: the SBM layer at ``--long`` lengths, batch 1, ~1% density: compiled memory
  and one timed fwd+bwd; exact and naive full attention at the same n compiled only
  (memory analysis).
* ``lra``: one training step (the trainer's ``make_train_step``: forward, loss,
  backward, AdamW) of the LRA encoder (Pathfinder paper config) at ``--lra-step``
  lengths with SBM; the full-attention encoder (its preset: ``implementation="auto"``)
  compiled only.
* ``core``: :func:`sbm_jax.edge_ops.edge_attention` on graphs drawn uniformly at fixed
  densities into the :class:`~sbm_jax.graph.EdgeList` layout (capacity
  ``ceil(density * n^2)`` slots), with ``edge_scale = straight_through(probs)``;
  gradients with respect to q, k, v and the edge probabilities. One per ``--impls``.
* ``dense``: the exact baseline core (``exact: chunked``, or ``exact: cudnn bf16`` on GPU),
  ``jax.nn.dot_product_attention`` (naive) and our
  :func:`~sbm_jax.edge_ops.dense_masked_attention` with an all-True mask.
* ``sample``: fastRG alone as the layer runs it (``sample_edge_keys``) at the capacity of
  the 5% core.
* ``calibrate`` (``--calibrate n``): the cost model's edge cost on this backend (see
  ``sbm_jax/kernels/cost.py``).

``core`` and ``sample`` map the (example, head) pairs as the layer's sparse branches do on
the backend (one head at a time on CPU, one ``vmap`` on GPU/TPU); the layer picks its own
mapping. Nothing here is CPU-specific: the same command runs on GPU and TPU.

Each figure is the median of ``--repeats`` (>= 5) timed calls after ``--warmup`` calls,
of one compiled function (long-sequence rows: one timed call); memory is XLA's compiled
memory analysis (``temp`` = scratch buffers beyond arguments and outputs).
Configurations whose compiled footprint exceeds ``--max-gib`` are skipped and listed.

Usage::

    python scripts/benchmark_attention.py --quick            # a few minutes
    python scripts/benchmark_attention.py --sizes 4096 --densities 0.01 0.05 \\
        --impls rows --no-targets --repeats 7 --long 32768 --lra-step 16384 \\
        --layer-processes 3 --markdown docs/benchmarks.md    # the documented run
    python scripts/benchmark_attention.py --no-core --no-sampler --long --lra-step \\
        --layer-cases 4096:0.05 --peers                      # one layer case, no peers
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:
    import resource  # page faults, system time and peak RSS of this process
except ImportError:  # not on this platform (Windows): those figures are left out
    resource = None

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sbm_jax import fastrg, script_usage  # noqa: E402
from sbm_jax.edge_ops import dense_masked_attention, edge_attention  # noqa: E402
from sbm_jax.graph import EdgeList  # noqa: E402
from sbm_jax.ste import straight_through  # noqa: E402

GIB = 2**30
TARGET_N = 4096

#: The other mechanisms measured as whole layers beside SBM (``--peers``), module defaults.
PEERS = (
    "performer",
    "linformer",
    "nystromformer",
    "reformer",
    "local",
    "sparse_strided",
    "sparse_fixed",
)


def baseline_options(dtype: Any = jnp.float32, backend: str | None = None) -> dict[str, Any]:
    """``full``'s options for the best exact attention on ``backend`` (default: this one):
    cuDNN flash attention on GPU in bfloat16/float16, else exact chunked attention."""
    from sbm_jax.attention.full import _is_cudnn_dtype

    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu" and _is_cudnn_dtype(dtype):
        return {"implementation": "cudnn"}
    return {"implementation": "chunked"}  # the layer's automatic block: the fastest here


def baseline_name(options: dict[str, Any]) -> str:
    """``"chunked"`` / ``"cudnn"``: how the tables name the baseline."""
    return str(options["implementation"])


# ----------------------------------------------------------------------------- inputs
def uniform_edge_arrays(
    rng: np.random.Generator, n: int, m: int, density: float, graphs: int
) -> dict[str, np.ndarray]:
    """``graphs`` uniform graphs in the EdgeList layout, stacked: ``[graphs, C]`` arrays.

    ``C = ceil(density * n * m)`` draws with replacement, collapsed and sorted by
    ``(row, col)``; empty slots (duplicates) follow with rows ``n - 1``.
    """
    cap = max(1, math.ceil(density * n * m))
    rows = np.full((graphs, cap), n - 1, np.int32)
    cols = np.zeros((graphs, cap), np.int32)
    valid = np.zeros((graphs, cap), bool)
    for g in range(graphs):
        keys = np.unique(rng.integers(0, n * m, size=cap, dtype=np.int64))
        e = keys.size
        rows[g, :e] = keys // m
        cols[g, :e] = keys % m
        valid[g, :e] = True
    probs = np.where(valid, rng.uniform(0.0, 1.0, size=valid.shape), 0.0).astype(np.float32)
    return {"rows": rows, "cols": cols, "valid": valid, "probs": probs}


def _split_bh(a: np.ndarray, b: int, h: int) -> jax.Array:
    return jnp.asarray(a.reshape(b, h, *a.shape[1:]))


# ----------------------------------------------------------------------------- timing
def compile_checked(
    fn: Callable[..., Any], args: Sequence[Any], max_bytes: float
) -> tuple[Any, dict[str, Any]]:
    """Compile ``fn`` and read XLA's memory analysis; ``None`` when it would not fit."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    info: dict[str, Any] = {"compile_s": round(compile_s, 3)}
    if mem is not None:
        info.update(
            temp_bytes=int(mem.temp_size_in_bytes),
            argument_bytes=int(mem.argument_size_in_bytes),
            output_bytes=int(mem.output_size_in_bytes),
            peak_bytes=int(getattr(mem, "peak_memory_in_bytes", 0) or 0),
        )
        footprint = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
        if footprint > max_bytes:
            info["skipped"] = f"compiled footprint {footprint / GIB:.1f} GiB > --max-gib"
            return None, info
    return compiled, info


def measure(
    fn: Callable[..., Any], args: Sequence[Any], *, repeats: int, warmup: int, max_bytes: float
) -> dict[str, Any]:
    """Compile ``fn``, read its memory analysis, then time it (median of ``repeats``)."""
    compiled, info = compile_checked(fn, args, max_bytes)
    if compiled is None:
        return info
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    calls = [timed_call(compiled, args) for _ in range(repeats)]
    info.update(call_summary(calls))
    return info


def _usage() -> tuple[int, float, float] | None:
    if resource is None:
        return None
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_stime, r.ru_utime


def timed_call(compiled: Any, args: Sequence[Any]) -> dict[str, float]:
    """One call of ``compiled``: wall seconds, and where the platform reports them the
    process's minor page faults, system and user CPU seconds during the call.

    On CPU, XLA allocates a program's temp buffer on every call; above glibc's mmap
    threshold (32 MiB at most) the allocation is a fresh mapping, so every page the
    program touches faults again, every call (see docs/benchmarks.md). User CPU over
    wall time is how many cores the call kept busy (XLA's worker threads count, spinning
    or working).
    """
    before = _usage()
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    call = {"s": time.perf_counter() - t}
    after = _usage()
    if before is not None and after is not None:
        call["faults"] = after[0] - before[0]
        call["sys_s"] = after[1] - before[1]
        call["user_s"] = after[2] - before[2]
    return call


def call_summary(calls: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Median wall time (and page faults, system and user CPU time) of timed calls."""
    times = [c["s"] for c in calls]
    out: dict[str, Any] = {
        "median_s": statistics.median(times),
        "times_s": [round(t, 6) for t in times],
    }
    if calls and all("faults" in c for c in calls):
        out["faults_per_call"] = statistics.median(c["faults"] for c in calls)
        out["sys_s_per_call"] = statistics.median(c["sys_s"] for c in calls)
    if calls and all("user_s" in c for c in calls):
        out["user_s_per_call"] = statistics.median(c["user_s"] for c in calls)
    return out


def measure_interleaved(
    workloads: Sequence[tuple[Callable[..., Any], Sequence[Any]]],
    *,
    repeats: int,
    warmup: int,
    max_bytes: float,
    shuffle_seed: int | None = None,
) -> list[dict[str, Any]]:
    """Like :func:`measure` for several workloads, timed in alternation (A B A B ...).

    On a shared machine the speed drifts between minutes; alternating the calls lets
    the drift fall on every workload alike, so their ratio is steadier than that of two
    back-to-back medians. Each info also gets ``round_ratios``: per round, its time over
    the first workload's.

    ``shuffle_seed``: shuffle the order within every round (``random.Random(seed)``)
    instead of the fixed A B C order. Worth it for many workloads of very different
    sizes: a call right after a large one (``full`` at n=4096 frees ~1 GiB) was
    measured ~2x slower than the same call later in the round, and a fixed order
    charges that to the same workload every round. The round ratios still pair the
    calls of one round.
    """
    infos, compiled = [], []
    for fn, args in workloads:
        exe, info = compile_checked(fn, args, max_bytes)
        infos.append(info)
        compiled.append(exe)
    live = [i for i, c in enumerate(compiled) if c is not None]
    for _ in range(warmup):
        for i in live:
            jax.block_until_ready(compiled[i](*workloads[i][1]))
    calls: dict[int, list[dict[str, float]]] = {i: [] for i in live}
    order = list(live)
    shuffle = None if shuffle_seed is None else random.Random(shuffle_seed).shuffle
    for _ in range(repeats):
        if shuffle is not None:
            shuffle(order)
        for i in order:
            calls[i].append(timed_call(compiled[i], workloads[i][1]))
    times = {i: [c["s"] for c in calls[i]] for i in live}
    for i in live:
        infos[i].update(call_summary(calls[i]))
        if live and live[0] == 0 and i != 0:
            rounds = [a / b for a, b in zip(times[i], times[0], strict=True)]
            infos[i]["round_ratios"] = [round(x, 4) for x in rounds]
            infos[i]["median_round_ratio"] = statistics.median(rounds)
    return infos


# ----------------------------------------------------------------------------- workloads
#: How ``core`` and ``sample`` map the (example, head) pairs (``--head-map``).
HEADS = {"mode": "layer"}


def over_heads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map a per-(example, head) function over ``[B, H, ...]`` inputs.

    ``--head-map layer`` (default): as the SBM layer's sparse branches do on this backend,
    one ``vmap`` on accelerators, one head at a time (``lax.map``) on CPU (see
    :func:`sbm_jax.attention.sbm.sparse_heads_per_step`). ``--head-map vmap``: always one
    ``vmap`` (the harness of the runs before 2026-11-26).
    """
    from sbm_jax.attention.sbm import map_over_heads, sparse_heads_per_step

    per_step = None if HEADS["mode"] == "vmap" else sparse_heads_per_step()
    return map_over_heads(fn, per_step)


def core_fwd_bwd(impl: str) -> Callable[..., Any]:
    """``(q, k, v [B,H,n,d], rows, cols, valid, probs [B,H,C], g [B,H,n,d]) -> grads``.

    ``edge_scale = straight_through(probs)``; heads are mapped as the layer maps them
    (:func:`over_heads`).
    """

    def loss(q, k, v, probs, rows, cols, valid, g):
        def one(q1, k1, v1, p1, r1, c1, ok1):
            edges = EdgeList(rows=r1, cols=c1, valid=ok1, probs=p1)
            scale = straight_through(p1)
            return edge_attention(q1, k1, v1, edges, edge_scale=scale, impl=impl)

        out = over_heads(one)(q, k, v, probs, rows, cols, valid)
        return jnp.sum(out * g)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


#: The ``dense`` section's name of the exact baseline core, by implementation.
EXACT_CORES = {"chunked": "exact: chunked", "cudnn": "exact: cudnn bf16"}


def dense_fwd_bwd(which: str) -> Callable[..., Any]:
    """``(q, k, v [B,H,n,d], g) -> grads`` for dense attention: ``which`` is one of
    :data:`EXACT_CORES`' names, ``jax.nn.dot_product_attention`` (naive) or
    ``dense_masked_attention``."""
    from sbm_jax.attention.full import chunked_attention, cudnn_attention, default_query_chunk

    def loss(q, k, v, g):
        t = lambda a: a.transpose(0, 2, 1, 3)  # [B, n, H, d]
        if which == "jax.nn.dot_product_attention":
            out = t(jax.nn.dot_product_attention(t(q), t(k), t(v)))
        elif which == EXACT_CORES["chunked"]:
            mask = jnp.ones(q.shape[:1] + q.shape[2:3], bool)
            chunk = default_query_chunk(k.shape[-2])
            out = t(chunked_attention(t(q), t(k), t(v), mask, query_chunk=chunk))
        elif which == EXACT_CORES["cudnn"]:
            mask = jnp.ones(q.shape[:1] + q.shape[2:3], bool)
            half = lambda a: t(a).astype(jnp.bfloat16)
            out = t(cudnn_attention(half(q), half(k), half(v), mask)).astype(q.dtype)
        else:
            n = q.shape[2]

            def one(q1, k1, v1):
                return dense_masked_attention(q1, k1, v1, jnp.ones((n, n), bool))

            out = jax.vmap(jax.vmap(one))(q, k, v)
        return jnp.sum(out * g)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def sampler_fn(law: str, capacity: int) -> Callable[..., Any]:
    """fastRG as the layer runs it, for every (example, head): ``(keys, plans) -> edges``.

    ``sample_edge_keys`` (slots by row, cluster and key inverse CDFs, sort,
    deduplication and, under bernoulli, ``p_e`` for the thinning) and
    ``edges_from_keys``; the layer never computes ``p_e`` after the draw (its
    straight-through estimator needs none). The per-row draw counts are an input, as in
    the layer (which draws them before it picks a capacity bucket): see
    :func:`fill_counts`. The thinning's budget and the prefix steps are the layer's for
    the head mapping (one graph at a time: a real ``lax.cond`` / ``lax.switch``).
    """
    from sbm_jax.attention.sbm import sampler_options, sparse_heads_per_step

    per_step = None if HEADS["mode"] == "vmap" else sparse_heads_per_step()
    options = dict(capacity=capacity, law=law, **sampler_options(per_step))

    def one(key, plan, row_counts):
        keys = fastrg.sample_edge_keys(key, plan, row_counts, **options)
        e = fastrg.edges_from_keys(keys, plan.y.shape[0], plan.z.shape[0])
        return e.rows, e.cols, e.valid

    return lambda keys, plans, counts: over_heads(one)(keys, plans, counts)


def fill_counts(key, plans, capacity: int) -> jax.Array:
    """Per-row draw counts ``[B, H, n]`` that fill all ``capacity`` slots of each head
    (``capacity`` draws split over the rows by the plan's multinomial)."""
    b, h = plans.row_rate.shape[:2]
    keys = jax.random.split(key, b * h).reshape(b, h, -1)
    split = jax.vmap(jax.vmap(lambda kk, p: fastrg.split_count(kk, p, capacity)))
    return jax.jit(split)(keys, plans)


def make_plans(key, b: int, h: int, n: int, clusters: int, density: float, law: str):
    """SBM plans whose expected density is ``density`` (memberships sigmoid(N(mu, 1)))."""
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (b, h, n, clusters))
    block = jax.nn.softmax(jax.random.normal(k2, (h, clusters * clusters))).reshape(
        h, clusters, clusters
    )

    def plans_for(mu):
        memb = jax.nn.sigmoid(logits + mu)

        def one(y, blk):
            return fastrg.make_plan(y, blk, y, delta=0.0, law=law)

        return jax.vmap(jax.vmap(one, in_axes=(0, 0)), in_axes=(0, None))(memb, block)

    lo, hi = -10.0, 5.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        dens = float(jnp.mean(plans_for(mid).expected_edges)) / (n * n)
        lo, hi = (mid, hi) if dens < density else (lo, mid)
    return plans_for(0.5 * (lo + hi))


# ----------------------------------------------------------------------------- layer
#: Sequence length at which the layer's density shift is found by bisection (the shift
#: depends on the token distribution, not on n; longer layers reuse it).
CALIBRATION_N = 2048


def _layer_inputs(b: int, n: int, width: int):
    kx, kg = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (b, n, width))
    g = jax.random.normal(kg, (b, n, width))
    return x, g, jnp.ones((b, n), bool)


def _shifted(base, lam, d):
    # Membership logits move by about -2 * lam: clusters += 2 e_0, MLP output bias
    # -= lam e_0 (e_0 the first unit vector of the head width).
    e = jnp.zeros((d,)).at[0].set(1.0)
    p = dict(base)
    p["clusters"] = base["clusters"] + 2.0 * e
    p["mlp_b2"] = base["mlp_b2"] - lam * e
    return p


def _path_name(rec: dict[str, Any]) -> str:
    """What a layer record's ``path`` stat means: the dense path, the fused kernel, or a
    capacity bucket."""
    if rec.get("dense_path"):
        return "dense"
    return "fused kernel" if rec.get("kernel") == "fused" else "bucket"


def stats_fn(mod, mask, key):
    """Jitted ``(params, x) -> stats`` of the SBM layer in training mode (one forward)."""
    from sbm_jax.attention import STATS_COLLECTION
    from sbm_jax.kernels.cost import resolve_kernel

    @jax.jit
    def run(params, x):
        _, st = mod.apply(
            {"params": params},
            x,
            mask,
            deterministic=False,
            rngs={"sample": key, "dropout": key},
            mutable=[STATS_COLLECTION],
        )
        s = st[STATS_COLLECTION]
        return jnp.mean(s["density"][0]), s["path"][0], jnp.sum(s["overflow"][0])

    def stats(params, x):
        dens, path, overflow = run(params, x)
        return {
            "density": float(dens),
            "path": int(path),
            "dense_path": int(path) == len(mod.capacity_buckets),
            "kernel": resolve_kernel(mod.kernel),
            "overflow": int(overflow),
        }

    return stats


def density_shift(mod, base, b: int, n: int, d: int, density: float, key) -> float:
    """The shift ``lam`` (see :func:`_shifted`) that gives ``density``, by bisection on the
    sampled density of the layer at ``n = min(n, CALIBRATION_N)`` (one compilation)."""
    n_cal = min(n, CALIBRATION_N)
    x, _, mask = _layer_inputs(b, n_cal, base["query"]["kernel"].shape[0])
    stats = stats_fn(mod, mask, key)
    lo, hi = -8.0, 8.0
    for _ in range(12):
        mid = 0.5 * (lo + hi)
        dens = stats(_shifted(base, mid, d), x)["density"]
        lo, hi = (mid, hi) if dens > density else (lo, mid)
    return 0.5 * (lo + hi)


_SHIFTS: dict[tuple, float] = {}


def fused_scratch(kernel: str, graphs: int, n: int, d: int, k: int) -> int | None:
    """Bytes of native scratch the fused CPU kernel holds for one SBM layer of ``graphs``
    (example, head) graphs of ``n`` tokens (outside XLA's buffers, so outside its memory
    analysis: added to the layer's temp bytes here), or None when the layer does not run
    it (another kernel or backend)."""
    from sbm_jax.kernels.cost import resolve_kernel

    if resolve_kernel(kernel) != "fused":
        return None
    from sbm_jax.kernels.fused import default_threads, scratch_bytes

    return scratch_bytes(graphs, n, n, d, d, k, threads=default_threads(), backward=True)


def with_native_scratch(rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` with its native scratch counted in ``temp_bytes`` (XLA's own figure kept as
    ``xla_temp_bytes``): a fused-kernel layer is compared on all the memory it holds."""
    extra = rec.get("native_scratch_bytes")
    if extra and "temp_bytes" in rec and "xla_temp_bytes" not in rec:
        rec["xla_temp_bytes"] = rec["temp_bytes"]
        rec["temp_bytes"] = rec["temp_bytes"] + extra
    return rec


def layer_workload(
    kind: str,
    b: int,
    h: int,
    d: int,
    n: int,
    density: float,
    options: dict[str, Any] | None = None,
    shift: float | None = None,
    dtype: Any = jnp.float32,
):
    """Return ``(fn, args, info)`` for a whole-layer fwd+bwd.

    ``kind="sbm"``: ``SBMAttention(num_heads=h, head_dim=d, out_dim=h*d, **options)``,
    the module's defaults unless ``options`` says otherwise, in training mode, with its
    membership logits shifted so that the sampled density is about ``density``.
    ``kind="full"``: the exact baseline, the ``full`` layer (same projections) with
    :func:`baseline_options` (or ``options``); ``kind="full_xla"``: the naive one
    (``implementation="xla"``); any other registered name (the :data:`PEERS`): that layer
    with its defaults (and its length options, Linformer's ``max_len = n``).
    ``dtype``: the layers' compute dtype.
    Gradients for all parameters and x. ``args`` is ``(params, x, g, mask)``: the padding
    mask and the cotangent ``g`` of the output are inputs of the step, not constants.
    ``shift``: use this membership shift instead of finding it (``info["shift"]``
    reports the one used).
    """
    from sbm_jax.attention import get_attention
    from sbm_jax.attention.registry import get_mechanism

    width = h * d
    kp, ks = jax.random.split(jax.random.PRNGKey(2))
    x, g, mask = _layer_inputs(b, n, width)
    fields = dict(num_heads=h, head_dim=d, out_dim=width, dtype=dtype)
    info: dict[str, Any] = {}
    if kind in ("full", "full_xla"):
        opts = options or (baseline_options(dtype) if kind == "full" else {"implementation": "xla"})
        mod = get_attention("full")(**fields, **opts)
        info["implementation"] = opts["implementation"]
    elif kind == "sbm":
        mod = get_attention("sbm")(**fields, **(options or {}))
    else:
        mechanism = get_mechanism(kind, field="--peers")
        opts = mechanism.length_options(n) if mechanism.length_options else {}
        mod = mechanism.module(**fields, **{**opts, **(options or {})})
    rngs = {"params": kp, "sample": ks, "dropout": ks}
    x0 = x[:, : min(n, 64)]  # parameter shapes do not depend on n
    params = jax.jit(lambda x: mod.init(rngs, x, mask[:, : x.shape[1]], deterministic=False))(x0)
    params = nn.unbox(params["params"])  # plain arrays (the logical axis names go)
    if kind == "sbm":
        sig = (b, min(n, CALIBRATION_N), h, d, density, tuple(sorted((options or {}).items())))
        if shift is None and sig not in _SHIFTS:
            _SHIFTS[sig] = density_shift(mod, params, b, n, d, density, ks)
        shift = _SHIFTS[sig] if shift is None else shift
        params = _shifted(params, shift, d)
        info["shift"] = shift
        stats = stats_fn(mod, mask, ks)(params, x)
        stats["sampled_density"] = stats.pop("density")
        info.update(stats)
        if mod.impl in ("auto", "sparse"):
            scratch = fused_scratch(mod.kernel, b * h, n, d, mod.num_clusters)
            if scratch is not None:
                info["native_scratch_bytes"] = scratch

    def loss(p, x, g, mask):
        out = mod.apply({"params": p}, x, mask, deterministic=False, rngs={"sample": ks})
        return jnp.sum(out.astype(jnp.float32) * g)

    # The padding mask (and the output's cotangent) are inputs of the compiled step, as
    # in a training step, where they come with the batch. Baked in as constants, the
    # all-true mask lets XLA fold full attention's masking away (n=1024: 66 against
    # 83 ms), a saving no model with a padding mask gets (docs/benchmarks.md).
    return jax.value_and_grad(loss, argnums=(0, 1)), (params, x, g, mask), info


def lra_step_workload(mechanism: str, n: int, batch: int):
    """One training step of the LRA encoder (``configs/lra/pathfinder.py`` at the paper
    scale: 2 layers, 2 heads, width 64, k=128) on inputs of ``n`` tokens (Path-X is
    128 x 128 = 16384), through the trainer's own ``make_train_step``: forward, loss,
    backward, AdamW update. Returns ``(compiled-able fn, args, info)``."""
    import configs.lra.pathfinder as pathfinder_config
    from sbm_jax.models.build import build_model
    from sbm_jax.training.host_data import split_micro_batches
    from sbm_jax.training.sharding import make_mesh
    from sbm_jax.training.state import ScheduleArgs, create_train_state, learning_rate_schedule
    from sbm_jax.training.steps import make_train_step
    from sbm_jax.training.task import Task

    config = pathfinder_config.get_config(mechanism)
    config.model.max_len = n
    config.task.max_length = n
    config.train.batch_size = batch
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, config.model.vocab_size, size=(batch, n)).astype(np.int32)
    data = {
        "inputs": inputs,
        "mask": np.ones((batch, n), bool),
        "targets": rng.integers(0, config.model.num_classes, size=(batch,)).astype(np.int32),
    }
    task = Task(name="path_x_mock", head="classification", train_batches=lambda s: iter([data]))
    model = build_model(config.model, "classification")
    state = create_train_state(config, model, task, data)
    mesh = make_mesh(1)
    schedule = learning_rate_schedule(*ScheduleArgs.of(config.train))
    step = make_train_step(task, mesh, float(config.train.density_lambda), schedule=schedule)
    info = {"batch": batch, "layers": int(config.model.num_layers)}
    if mechanism == "sbm":
        opts = config.model.attention_options
        heads = int(config.model.num_heads)
        kernel = str(opts.get("kernel", "auto"))
        head_dim = int(config.model.head_dim)
        scratch = fused_scratch(kernel, batch * heads, n, head_dim, int(opts.num_clusters))
        if scratch is not None:  # one pool, shared by the layers (same sizes)
            info["native_scratch_bytes"] = scratch
    return step, (state, split_micro_batches(data, 1)), info


def calibrate_edge_cost(
    b: int, h: int, d: int, n: int, density: float, kernels: Sequence[str], **kw
) -> dict[str, Any]:
    """Measure the cost model's slot cost (``sbm_jax.kernels.cost.EDGE_COST``) here.

    The SBM layer with ``impl="dense"`` against the same layer (same parameters, shifted
    to ``density``) with ``impl="sparse"`` and one bucket of ``C = 2 density n^2`` slots
    (about half filled, as a bucket typically is with buckets 4x apart; no dense
    branch), timed in alternation: ``edge_cost = (t_sparse / C) / (t_dense / n^2)``, from
    the median of the per-round time ratios. Both times are whole layers (fwd+bwd), so
    the parts outside attention (projections, plans) count on both sides; at n >= 2048
    they are a few percent.
    """
    frac = 2.0 * density
    fn_d, args_d, info_d = layer_workload("sbm", b, h, d, n, density, {"impl": "dense"})
    loads, infos = [(fn_d, args_d)], [info_d]
    for kernel in kernels:
        if kernel == "fused":  # no buckets: the fused kernel on every batch
            sparse = {"impl": "sparse", "max_dense_elements": 0, "kernel": "fused"}
        else:
            sparse = {
                "impl": "sparse",
                "capacity_buckets": (frac,),
                "max_dense_elements": 0,
                "kernel": kernel,
            }
        fn_s, args_s, info_s = layer_workload("sbm", b, h, d, n, density, sparse, info_d["shift"])
        loads.append((fn_s, args_s))
        infos.append(info_s)
    measured = measure_interleaved(loads, **kw)
    cap = math.ceil(frac * n * n)
    out = {"n": n, "density": density, "capacity": cap, "dense": info_d, "edge_cost": {}}
    for kernel, info, m in zip(kernels, infos[1:], measured[1:], strict=True):
        out[kernel] = info
        if "median_round_ratio" in m:
            # The fused kernel's unit is a sampled edge (a draw, up to the collapse and the
            # thinning; the layer weighs draws); a bucket's is one of its slots.
            per = info["sampled_density"] * n * n if kernel == "fused" else cap
            out["edge_cost"][kernel] = m["median_round_ratio"] * n * n / per
    out["times_s"] = [m.get("times_s") for m in measured]
    out["temp_bytes"] = [m.get("temp_bytes") for m in measured]
    return out


# ----------------------------------------------------------------------------- NNX face
#: How much slower than the Linen layer the NNX SBM layer may be (``--nnx``): 5%.
NNX_TARGET = 1.05


def nnx_layer_workloads(
    b: int,
    h: int,
    d: int,
    n: int,
    density: float,
    options: dict[str, Any] | None = None,
    dtype: Any = jnp.float32,
) -> tuple[list[tuple[Callable[..., Any], Sequence[Any]]], dict[str, Any]]:
    """The SBM layer's fwd+bwd through the Linen module and through its NNX face
    (``sbm_jax.nnx.SBMAttention``) on the same parameters (those of
    :func:`layer_workload`, shifted to ``density``), inputs and sample key, so all
    sample the same graph. Returns ``([linen, nnx, linen_stats], info)``, each an
    ``(fn, args)`` pair.

    ``linen`` is :func:`layer_workload`'s step, whose sown stats XLA drops as unused;
    ``nnx`` is what ``nnx.jit`` of ``nnx.value_and_grad`` compiles: merge the layer,
    differentiate with respect to its ``nnx.Param``s and x, and return its updated
    state (the stats it sowed, its rng count) as a training step writes it back;
    ``linen_stats`` is the Linen step as the trainer runs it, the stats collected
    (``mutable=["attention_stats"]``) and returned.
    """
    from flax import nnx

    from sbm_jax import nnx as sbm_nnx
    from sbm_jax.attention import STATS_COLLECTION, get_attention

    _, (params, x, g, mask), info = layer_workload("sbm", b, h, d, n, density, options, None, dtype)
    fields = dict(num_heads=h, head_dim=d, dtype=dtype)
    layer = sbm_nnx.SBMAttention(
        in_features=h * d, rngs=nnx.Rngs(0, sample=1), **fields, **(options or {})
    )
    layer.load_linen_params(params)
    stream = layer.sample_rng
    key = jax.random.fold_in(stream.key[...], stream.count[...])  # what the layer draws
    mod = get_attention("sbm")(out_dim=h * d, **fields, **(options or {}))

    def linen_loss(p, x, g, mask):
        out = mod.apply({"params": p}, x, mask, deterministic=False, rngs={"sample": key})
        return jnp.sum(out.astype(jnp.float32) * g)

    def linen_stats_loss(p, x, g, mask):
        out, stats = mod.apply(
            {"params": p},
            x,
            mask,
            deterministic=False,
            rngs={"sample": key},
            mutable=[STATS_COLLECTION],
        )
        return jnp.sum(out.astype(jnp.float32) * g), stats

    graphdef, state = nnx.split(layer)

    def nnx_step(state, x, g, mask):
        model = nnx.merge(graphdef, state)

        def loss(model, x):
            return jnp.sum(model(x, mask).astype(jnp.float32) * g)

        value_grads = nnx.value_and_grad(loss, argnums=(0, 1))(model, x)
        return value_grads, nnx.state(model)

    linen_fn = jax.value_and_grad(linen_loss, argnums=(0, 1))
    stats_fn = jax.value_and_grad(linen_stats_loss, argnums=(0, 1), has_aux=True)
    loads = [
        (linen_fn, (params, x, g, mask)),
        (nnx_step, (state, x, g, mask)),
        (stats_fn, (params, x, g, mask)),
    ]
    linen_value, _ = jax.jit(linen_fn)(params, x, g, mask)
    (nnx_value, _), new_state = jax.jit(nnx_step)(state, x, g, mask)
    stats = nnx.merge(graphdef, new_state).stats.get_value()
    info.update(
        linen_loss=float(linen_value),
        nnx_loss=float(nnx_value),
        nnx_density=float(jnp.mean(stats["density"])),
        nnx_path=int(stats["path"]),
    )
    return loads, info


def program_cost(fn: Callable[..., Any], args: Sequence[Any]) -> dict[str, float]:
    """XLA's cost analysis of ``fn`` compiled on ``args``: its FLOPs and bytes accessed
    (what the program does, free of the timing noise of a shared machine)."""
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in (cost or {})}


def _paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Median over rounds of ``a``'s time over ``b``'s in the same round."""
    if "times_s" not in a or "times_s" not in b:
        return None
    return statistics.median(x / y for x, y in zip(a["times_s"], b["times_s"], strict=True))


def run_nnx(args: argparse.Namespace) -> dict[str, Any]:
    """``--nnx``: per ``--layer-cases`` case, the NNX SBM layer against the Linen one,
    fwd+bwd, timed in alternation (shuffled within each round) in this process, with the
    Linen step as the trainer runs it (stats collected) beside them.
    ``nnx_over_linen`` is the median of the per-round time ratios against the bare
    Linen layer (target: at most :data:`NNX_TARGET`), ``nnx_over_linen_stats`` against
    the Linen step that collects the same stats; ``cost`` is XLA's count of each
    program's FLOPs and bytes."""
    kw = dict(repeats=args.repeats, warmup=args.warmup, max_bytes=args.max_gib * GIB)
    dtype = layer_dtype(args.layer_dtype)
    results = []
    for n, density, batch in args.layer_cases:
        b = args.batch if batch is None else batch
        loads, info = nnx_layer_workloads(
            b, args.heads, args.head_dim, n, density, args.layer_options, dtype
        )
        linen, nnx_, linen_stats = measure_interleaved(loads, shuffle_seed=0, **kw)
        ratio = nnx_.get("median_round_ratio")
        rec = dict(section="nnx", n=n, density=density, batch=b, heads=args.heads, **info)
        rec.update(linen=linen, nnx=nnx_, linen_stats=linen_stats, nnx_over_linen=ratio)
        rec["nnx_over_linen_stats"] = _paired_ratio(nnx_, linen_stats)
        names = ("linen", "nnx", "linen_stats")
        rec["cost"] = {name: program_cost(*load) for name, load in zip(names, loads, strict=True)}
        rec["met"] = None if ratio is None else bool(ratio <= NNX_TARGET)
        results.append(rec)
        if args.json:
            out = Path(args.json)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**header(args), "results": results}, indent=1))
    return {**header(args), "results": results}


def print_nnx(report: dict[str, Any]) -> None:
    """Per ``--nnx`` case: the medians, the per-round ratios and XLA's cost counts."""
    print(f"NNX SBM layer against the Linen one, fwd+bwd ({machine_text(report['machine'])}):")
    for r in report["results"]:
        ratio, lin, nx, ls = r["nnx_over_linen"], r["linen"], r["nnx"], r["linen_stats"]
        rounds = nx.get("round_ratios") or [float("nan")]
        print(
            f"  n={r['n']} {r['density']:.0%} B={r['batch']}: linen {_fmt(lin.get('median_s'))}"
            f" s, nnx {_fmt(nx.get('median_s'))} s, nnx/linen {_fmt(ratio, '.3f')} (rounds "
            f"{min(rounds):.3f}-{max(rounds):.3f}; target <= {NNX_TARGET}: "
            f"{'met' if r['met'] else 'not met'}); linen with stats {_fmt(ls.get('median_s'))}"
            f" s, nnx/it {_fmt(r['nnx_over_linen_stats'], '.3f')}; sampled density "
            f"{r['nnx_density']:.3f}, same loss {r['linen_loss'] == r['nnx_loss']}"
        )
        for name in ("linen", "nnx", "linen_stats"):
            cost, rec = r["cost"].get(name, {}), r[name]
            print(
                f"    {name:11s} temp {_fmt(rec.get('temp_bytes'))} B, "
                f"{_fmt(cost.get('flops'), '.6g')} FLOPs, "
                f"{_fmt(cost.get('bytes accessed'), '.6g')} bytes accessed"
            )


def nnx_main(args: argparse.Namespace) -> None:
    """``--nnx``: measure, write ``--json``, print; nothing else runs."""
    report = run_nnx(args)
    print_nnx(report)
    if args.json:
        print(f"wrote {args.json}")


# ----------------------------------------------------------------------------- driver
#: Whole-layer cases: (n, density, batch), those of the layer target table
#: (:func:`layer_target_rows`).
LAYER_CASES = ((4096, 0.05, 2), (4096, 0.01, 2), (16384, 0.01, 1), (2048, 0.9, 2))


def parse_args(argv=None) -> argparse.Namespace:
    p = script_usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.10, 0.25])
    p.add_argument("--impls", nargs="+", default=["segment", "rows"], help="core kernels")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--clusters", type=int, default=128, help="SBM k for the sampler")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-gib", type=float, default=6.0, help="skip larger compiled programs")
    p.add_argument(
        "--layer-cases",
        nargs="*",
        default=[f"{n}:{dd}:{bb}" for n, dd, bb in LAYER_CASES],
        help="whole-layer cases n:density[:batch] (batch default --batch; the module's "
        "defaults against exact full attention)",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=list(PEERS),
        help="other mechanisms timed as whole layers beside SBM at --peer-sizes",
    )
    p.add_argument(
        "--peer-sizes",
        type=int,
        nargs="*",
        default=[TARGET_N],
        help="the layer cases' lengths n at which the --peers are measured too",
    )
    p.add_argument(
        "--layer-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="compute dtype of every whole layer (auto: bfloat16 on GPU, where the exact "
        "baseline is cuDNN's, else float32)",
    )
    p.add_argument(
        "--no-naive",
        action="store_true",
        help="leave XLA's naive full attention out of the layer cases",
    )
    p.add_argument(
        "--long",
        type=int,
        nargs="*",
        default=[16384, 32768],
        help="long-sequence layer runs (batch 1, ~1%% density): one timed fwd+bwd each, "
        "beside full attention's compiled memory",
    )
    p.add_argument("--long-density", type=float, default=0.01)
    p.add_argument(
        "--lra-step",
        type=int,
        nargs="*",
        default=[16384],
        help="lengths of one LRA-encoder training step with SBM (batch --lra-batch)",
    )
    p.add_argument("--lra-batch", type=int, default=1)
    p.add_argument(
        "--calibrate",
        type=int,
        nargs="*",
        default=[],
        help="measure the cost model's edge cost at these n (see kernels/cost.py)",
    )
    p.add_argument(
        "--head-map",
        default="layer",
        choices=["layer", "vmap"],
        dest="heads_mode",
        help="map core/sampler heads as the layer does on this backend, or one vmap",
    )
    p.add_argument(
        "--layer-options",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="SBMAttention fields for the whole-layer SBM rows instead of the module's "
        "defaults, e.g. ste=pairs pair_probes=8 (ints, floats and strings)",
    )
    p.add_argument(
        "--sbm-variant",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="one more SBM row per layer case, with these fields over --layer-options "
        "(e.g. edge_cache=256), timed in the same rounds as the others",
    )
    p.add_argument(
        "--layer-processes",
        type=int,
        default=0,
        metavar="K",
        help="measure each whole-layer case in K fresh processes of this script, one after "
        "another, and report the medians over them with their range (0: in this process, "
        "after the core and sampler runs)",
    )
    p.add_argument(
        "--nnx",
        action="store_true",
        help="only time the NNX SBM layer (sbm_jax.nnx) against the Linen one at the "
        "--layer-cases, in alternation in this process, and report their ratio",
    )
    p.add_argument("--no-layer", action="store_true", help="skip the whole-layer figures")
    p.add_argument("--no-core", action="store_true", help="skip the dense and core figures")
    p.add_argument("--no-sampler", action="store_true", help="skip the fastRG figures")
    p.add_argument("--no-targets", action="store_true", help="do not add the target runs")
    p.add_argument("--quick", action="store_true", help="small sizes, no long runs")
    p.add_argument("--json", default="benchmark_attention.json", help="output JSON path")
    p.add_argument("--markdown", default=None, help="write the tables into this .md file")
    p.add_argument(
        "--from-json", default=None, help="re-render the tables of a saved run; measure nothing"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = [1024, 2048]
        args.densities = [0.01, 0.05]
        args.layer_cases = ["1024:0.05"]
        args.peer_sizes = [1024]
        args.long, args.lra_step = [], []
        args.no_targets = True
    if args.repeats < 5:
        p.error(f"--repeats must be >= 5 (median of at least 5), got {args.repeats}")
    if any(not 0.0 < dd <= 1.0 for dd in args.densities):
        p.error(f"--densities must lie in (0, 1], got {args.densities}")
    if not 0.0 < args.long_density <= 1.0:
        p.error(f"--long-density must lie in (0, 1], got {args.long_density}")
    try:
        args.layer_cases = [_layer_case(c) for c in args.layer_cases]
    except (IndexError, ValueError):
        p.error(
            "--layer-cases must look like 4096:0.05 or 16384:0.01:1 (n >= 1, density in "
            f"(0, 1], batch >= 1), got {' '.join(args.layer_cases)}"
        )
    from sbm_jax.attention import available

    unknown = [name for name in args.peers if name not in available() or name == "sbm"]
    if unknown:
        others = [name for name in available() if name != "sbm"]
        p.error(f"--peers: {' '.join(unknown)} not among the mechanisms {' '.join(others)}")
    check_numbers(
        p,
        args,
        positive=("sizes", "batch", "heads", "head_dim", "clusters", "long", "lra_step"),
        non_negative=("warmup", "layer_processes"),
    )
    check_numbers(p, args, positive=("lra_batch", "calibrate", "max_gib", "peer_sizes"))
    from sbm_jax.kernels import KERNELS

    impls = ("segment", *KERNELS, "fused")  # fused: the whole CPU kernel (--calibrate only)
    for impl in args.impls:
        if impl not in impls:
            p.error(f"--impls: {impl!r} is not a core kernel; choose from {', '.join(impls)}")
    args.layer_option_items = list(args.layer_options)  # as typed: passed on to children
    args.sbm_variant_items = list(args.sbm_variant)
    try:
        args.layer_options = layer_options(args.layer_options)
        args.sbm_variant = layer_options(args.sbm_variant)
    except ValueError as err:
        p.error(str(err))
    check_paths(p, args, markers=((BEGIN, END), _OLD_MARKERS))
    return args


def _layer_case(text: str) -> tuple[int, float, int | None]:
    """``"4096:0.05"`` -> ``(4096, 0.05, None)`` (the run's ``--batch``),
    ``"16384:0.01:1"`` -> ``(16384, 0.01, 1)``; a ValueError unless n >= 1, density in
    (0, 1] and batch >= 1."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(text)
    n, density = int(parts[0]), float(parts[1])
    batch = int(parts[2]) if len(parts) == 3 else None
    if n < 1 or not 0.0 < density <= 1.0 or (batch is not None and batch < 1):
        raise ValueError(text)
    return n, density, batch


def layer_dtype(name: str) -> Any:
    """``--layer-dtype`` as a dtype (``auto``: bfloat16 on GPU, else float32)."""
    if name == "auto":
        name = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return jnp.dtype(name)


#: The record kind of the ``--sbm-variant`` row (an SBM layer with other fields).
VARIANT = "sbm_variant"
#: Record kinds that are SBM layers (sampled density, edges per byte).
SBM_KINDS = ("sbm", VARIANT)


def case_kinds(args: argparse.Namespace, n: int) -> list[str]:
    """The layers of a case at length ``n``, the exact baseline first (every time ratio is
    the median of the per-round ratios to it): ``full``, ``full_xla``, ``sbm``, the
    ``--sbm-variant`` row, and the peers where ``n`` is one of ``--peer-sizes``."""
    kinds = ["full", *([] if args.no_naive else ["full_xla"]), "sbm"]
    kinds += [VARIANT] if getattr(args, "sbm_variant_items", None) else []
    return kinds + (list(args.peers) if n in args.peer_sizes else [])


def check_numbers(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    positive: Sequence[str] = (),
    non_negative: Sequence[str] = (),
) -> None:
    """One-line errors (the benchmark and profile scripts) for a size, count or limit
    flag below its least sensible value (a list flag: any of its values); ``None`` (an
    unset optional flag) passes."""
    for names, least, words in ((positive, 0, "> 0"), (non_negative, -1, ">= 0")):
        for name in names:
            value = getattr(args, name)
            values = value if isinstance(value, list) else [value]
            bad = [v for v in values if v is not None and not v > least]
            if bad:
                flag = "--" + name.replace("_", "-")
                p.error(f"{flag} must be {words}, got {' '.join(str(v) for v in bad)}")


def check_paths(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    markers: Sequence[tuple[str, str]] = (),
) -> None:
    """One-line errors (the benchmark and profile scripts) for a ``--from-json`` that is
    not a JSON report (read into ``args.report``), a ``--json`` / ``--markdown`` that
    cannot be written (a directory, a missing folder, no permission) and a
    ``--markdown`` file whose generated block's ``markers`` (begin, end) are unpaired
    or repeated: found before a run that may take many minutes, not after it."""
    from_json = getattr(args, "from_json", None)
    if from_json:
        args.report = read_report(p, from_json)
    outputs = ["markdown"] if from_json else ["json", "markdown"]
    for flag in outputs:
        path = getattr(args, flag, None)
        if path is None:
            continue
        why = "is empty" if not path else unwritable(path)
        if why:
            p.error(f"--{flag} {path!r}: {why}")
    markdown_path = getattr(args, "markdown", None)
    if markdown_path and os.path.isfile(markdown_path):
        try:
            text = Path(markdown_path).read_text()
        except (OSError, UnicodeDecodeError) as err:
            p.error(f"--markdown {markdown_path!r}: cannot read it ({err})")
        for begin, end in markers:  # as write_markdown looks for them
            try:
                if replace_block(text, begin, end, "") is not None:
                    break
            except ValueError as err:
                p.error(f"--markdown {markdown_path!r}: {err}; fix the file by hand")


def read_report(p: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The saved report ``--from-json`` names: a JSON object with a ``results`` list."""
    if not os.path.isfile(path):
        p.error(f"--from-json: no such file {path!r}")
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        p.error(f"--from-json {path!r}: not a JSON report ({err})")
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        p.error(f"--from-json {path!r}: not a report of this script (no 'results' list)")
    return report


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written as a file, or None when it can (a missing file is
    created and removed again to find out: permissions and read-only or pseudo file
    systems such as /proc say so only then)."""
    if os.path.isdir(path):
        return "is a directory"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"folder {folder!r} does not exist"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is not writable"
    try:
        with open(path, "x"):
            pass
    except OSError as err:
        return f"cannot be created ({err.strerror or err})"
    os.remove(path)
    return None


def layer_options(items: Sequence[str]) -> dict[str, Any]:
    """``--layer-options`` items (``FIELD=VALUE``) as SBMAttention options, checked as the
    layer checks them: an unknown field or a bad value is a ValueError naming it, before
    anything is compiled (a misspelt field used to skip every SBM row and run on)."""
    from sbm_jax.attention.registry import build_attention

    options = dict(_option(item) for item in items)
    layer = build_attention(
        "sbm", options=options, option_field="--layer-options", num_heads=1, head_dim=1, out_dim=1
    )
    layer.validate()
    return options


def _option(item: str) -> tuple[str, Any]:
    """``"ste=pairs"`` -> ``("ste", "pairs")``; ``"pair_probes=8"`` -> ``(.., 8)``."""
    field, sep, text = item.partition("=")
    if not sep or not field:
        raise ValueError(f"--layer-options takes FIELD=VALUE items, got {item!r}")
    for kind in (int, float):
        try:
            return field, kind(text)
        except ValueError:
            pass
    return field, text


def _peak_rss_gib() -> float | None:
    if resource is None:
        return None
    try:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except AttributeError:
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    HEADS["mode"] = args.heads_mode
    b, h, d = args.batch, args.heads, args.head_dim
    max_bytes = args.max_gib * GIB
    kw = dict(repeats=args.repeats, warmup=args.warmup, max_bytes=max_bytes)
    results: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)

    # Core grid, plus the configurations the target tables need.
    grid = {(n, dd) for n in args.sizes for dd in args.densities}
    if not args.no_targets:
        grid |= {(TARGET_N, 0.01), (TARGET_N, 0.05), (TARGET_N // 2, 0.10)}
    sizes = sorted({n for n, _ in grid})

    def save_partial() -> None:
        # After every record: a run stopped by a timeout or a crash keeps what it measured
        # (`"partial": true`; `--from-json` renders it).
        if args.json:
            out = Path(args.json)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**header(args), "results": results, "partial": True}))

    def log(rec):
        results.append(rec)
        save_partial()
        what = rec.get("impl", rec.get("kind", ""))
        if "median_s" in rec:
            t = f"{rec['median_s'] * 1e3:9.1f} ms"
        else:
            t = rec.get("skipped", "")
        tmp = rec.get("temp_bytes")
        tmp = f"temp {tmp / 2**20:8.1f} MiB" if tmp is not None else ""
        print(
            f"[{rec['section']:6s}] n={rec['n']:5d} dens={rec.get('density', ''):<6} "
            f"{what:30s} {t} {tmp}",
            flush=True,
        )

    core_load = None  # the rows core at n=4096, 5%: fastRG's target is timed against it
    for n in sizes:
        key = jax.random.PRNGKey(n)
        kq, kk, kv, kg = jax.random.split(key, 4)
        shape = (b, h, n, d)
        q, k, v, g = (jax.random.normal(kk_, shape) for kk_ in (kq, kk, kv, kg))
        exact = EXACT_CORES[baseline_name(baseline_options(jnp.bfloat16))]
        for which in (exact, "jax.nn.dot_product_attention", "dense_masked_attention")[
            : 0 if args.no_core else 3
        ]:
            rec = {"section": "dense", "n": n, "impl": which}
            rec.update(measure(dense_fwd_bwd(which), (q, k, v, g), **kw))
            log(rec)
        for dd in sorted(dd for nn_, dd in grid if nn_ == n and not args.no_core):
            cap = math.ceil(dd * n * n)
            slots = b * h * cap
            if slots * 13 > max_bytes / 2:
                for impl in (i for i in args.impls if i != "fused"):
                    log(
                        {
                            "section": "core",
                            "n": n,
                            "density": dd,
                            "impl": impl,
                            "skipped": f"edge arrays alone need {slots * 13 / GIB:.1f} GiB",
                        }
                    )
                continue
            arr = uniform_edge_arrays(rng, n, n, dd, b * h)
            ea = {name: _split_bh(a, b, h) for name, a in arr.items()}
            edges_valid = int(arr["valid"].sum())
            for impl in (i for i in args.impls if i != "fused"):
                rec = {
                    "section": "core",
                    "n": n,
                    "density": dd,
                    "impl": impl,
                    "capacity": cap,
                    "edges": edges_valid,
                }
                if impl == "segment" and slots * 800 > max_bytes:
                    rec["skipped"] = (
                        f"segment temporaries ~{slots * 800 / GIB:.0f} GiB (~800 B per slot)"
                    )
                else:
                    fn = core_fwd_bwd(impl)
                    a = (q, k, v, ea["probs"], ea["rows"], ea["cols"], ea["valid"], g)
                    rec.update(measure(fn, a, **kw))
                    if (n, dd, impl) == (TARGET_N, 0.05, "rows"):
                        core_load = (fn, a)  # fastRG is timed against it below
                log(rec)
                if "skipped" not in rec and n == TARGET_N and HEADS["mode"] != "vmap":
                    # Memory only (compiled, not run): the heads in one vmap, as the
                    # layer maps them on accelerators and as the dense baseline does.
                    mode, HEADS["mode"] = HEADS["mode"], "vmap"
                    try:
                        _, info = compile_checked(core_fwd_bwd(impl), a, max_bytes)
                    finally:
                        HEADS["mode"] = mode
                    mem = {"section": "core-mem", "n": n, "density": dd, "impl": impl}
                    mem.update(heads="vmap", capacity=cap, **info)
                    log(mem)
            del arr, ea

        if not args.no_sampler and (n == TARGET_N or n in args.sizes):
            cap = math.ceil(0.05 * n * n)
            plans = make_plans(jax.random.PRNGKey(7), b, h, n, args.clusters, 0.05, "bernoulli")
            keys = jax.random.split(jax.random.PRNGKey(3), b * h).reshape(b, h, -1)
            counts = fill_counts(jax.random.PRNGKey(4), plans, cap)
            for law in ("bernoulli", "poisson"):
                rec = {"section": "sample", "n": n, "density": 0.05, "kind": f"fastRG {law}"}
                rec["capacity"] = cap
                load = (sampler_fn(law, cap), (keys, plans, counts))
                if law == "bernoulli" and n == TARGET_N and core_load is not None:
                    # In alternation with the attention core (rows, 5%): the target's
                    # ratio is the median of the per-round ratios, as for the layers.
                    core_info, info = measure_interleaved([core_load, load], **kw)
                    info["core_median_s"] = core_info["median_s"]
                    rec.update(info)
                else:
                    rec.update(measure(*load, **kw))
                log(rec)

    if not args.no_layer:
        dtype = layer_dtype(args.layer_dtype)
        for n, dd, case_batch in args.layer_cases:
            bc = b if case_batch is None else case_batch
            if args.layer_processes:
                for rec in layer_case_in_processes(args, n, dd, case_batch):
                    log(rec)
                continue
            # The exact baseline first, then the naive full layer, SBM (the module's
            # defaults) and the peers, timed in alternation, shuffled within each round.
            recs, loads = [], []
            shift = None  # the variant's membership shift is the plain SBM row's
            for kind in case_kinds(args, n):
                rec = {"section": "layer", "n": n, "density": dd, "kind": kind, "batch": bc}
                rec.update(heads=h, dtype=jnp.dtype(dtype).name)
                options = args.layer_options if kind == "sbm" else None
                if kind == VARIANT:
                    options = {**args.layer_options, **args.sbm_variant}
                    rec["variant"] = " ".join(args.sbm_variant_items)
                try:
                    workload = "sbm" if kind == VARIANT else kind
                    fn, a, info = layer_workload(
                        workload, bc, h, d, n, dd, options, dtype=dtype, shift=shift
                    )
                    if kind == "sbm":
                        shift = info.get("shift")
                except Exception as err:  # report, never hide: a failed layer is a result
                    rec["skipped"] = f"{type(err).__name__}: {err}"
                    log(rec)
                    continue
                rec.update(info)
                recs.append(rec)
                loads.append((fn, a))
            if recs and recs[0]["kind"] != "full":  # no baseline: no ratios, still times
                recs[0]["note"] = "the exact baseline failed: no ratios"
            shuffle = 0 if len(loads) > 2 else None
            measured = measure_interleaved(loads, shuffle_seed=shuffle, **kw)
            for rec, info in zip(recs, measured, strict=True):
                rec.update(info)
                with_native_scratch(rec)
                if recs[0]["kind"] != "full":
                    rec.pop("median_round_ratio", None)
                    rec.pop("round_ratios", None)
                log(rec)

    for n in args.long:
        # Batch 1: the SBM layer runs (one warm-up and one timed fwd+bwd); full attention
        # at this n is only compiled (its memory analysis), it does not fit to run here.
        bl = 1
        for kind in ("full", "full_xla"):
            rec = {"section": "long", "n": n, "density": args.long_density, "kind": kind}
            fn, a, info = layer_workload(kind, bl, h, d, n, args.long_density)
            rec.update(info)
            _, info = compile_checked(fn, a, float("inf"))
            rec.update(info, batch=bl, note="compiled only")
            log(rec)
        rec = {"section": "long", "n": n, "density": args.long_density, "kind": "sbm"}
        fn, a, info = layer_workload("sbm", bl, h, d, n, args.long_density)
        rec.update(info, batch=bl)
        rec.update(measure(fn, a, repeats=1, warmup=1, max_bytes=float("inf")))
        with_native_scratch(rec)
        rec["peak_rss_gib"] = _peak_rss_gib()
        log(rec)

    for n in args.lra_step:
        for mechanism in ("full", "sbm"):
            rec = {"section": "lra", "n": n, "kind": mechanism}
            fn, a, info = lra_step_workload(mechanism, n, args.lra_batch)
            rec.update(info)
            if mechanism == "full":
                _, cinfo = compile_checked(fn, a, float("inf"))
                rec.update(cinfo, note="compiled only")
            else:
                rec.update(measure(fn, a, repeats=1, warmup=1, max_bytes=float("inf")))
                with_native_scratch(rec)
                rec["peak_rss_gib"] = _peak_rss_gib()
            log(rec)

    for n in args.calibrate:
        rec = {"section": "calibrate", "n": n, "kind": "edge cost"}
        rec.update(calibrate_edge_cost(b, h, d, n, 0.05, args.impls, **kw))
        print(f"[calib ] n={n} edge_cost={rec.get('edge_cost')}", flush=True)
        results.append(rec)
        save_partial()

    return {**header(args), "results": results}


def layer_child_command(
    args: argparse.Namespace, n: int, density: float, out: str, batch: int | None = None
) -> list[str]:
    """This script measuring the layer case ``n:density[:batch]`` alone (nothing else in
    the process), with this run's sizes, repeats, head mapping, layer dtype, peers and
    layer options, its report written to ``out``."""
    cmd = [sys.executable, str(Path(__file__).resolve())]
    cmd += ["--no-core", "--no-sampler", "--no-targets", "--long", "--lra-step"]
    case = f"{n}:{density}" + ("" if batch is None else f":{batch}")
    cmd += ["--layer-cases", case, "--batch", str(args.batch)]
    cmd += ["--layer-dtype", args.layer_dtype, "--peers", *args.peers]
    cmd += ["--peer-sizes", *(str(x) for x in args.peer_sizes)]
    cmd += ["--no-naive"] if args.no_naive else []
    cmd += ["--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    cmd += ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    cmd += ["--max-gib", str(args.max_gib), "--head-map", args.heads_mode, "--json", out]
    if args.layer_option_items:
        cmd += ["--layer-options", *args.layer_option_items]
    if args.sbm_variant_items:
        cmd += ["--sbm-variant", *args.sbm_variant_items]
    return cmd


#: Per-call figures of a layer record that are summarised over processes by their median.
_PER_PROCESS = ("median_s", "faults_per_call", "sys_s_per_call", "user_s_per_call")


def merge_process_records(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One layer record per kind (``full``, ``full_xla``, ``sbm``, peers, in the order they
    first appear) from the records of K processes that each measured the same case.

    Each figure in :data:`_PER_PROCESS` and each layer's ``median_round_ratio`` become
    the median over the processes that timed the layer, and the per-process values are
    kept (``process_<name>``). Compiled memory, path and density are the first timed
    process's (the same program and seeds in every process). A layer no process timed
    keeps the first process's record (its ``skipped`` reason).
    """
    merged = []
    layer = [r for run in runs for r in run if r.get("section") == "layer"]
    for kind in dict.fromkeys(r.get("kind") for r in layer):
        recs = [r for r in layer if r.get("kind") == kind]
        timed = [r for r in recs if "median_s" in r]
        if not timed:
            if recs:
                merged.append(dict(recs[0]))
            continue
        rec = {k: v for k, v in timed[0].items() if k not in ("times_s", "round_ratios")}
        rec["processes"] = len(timed)
        for name in (*_PER_PROCESS, "median_round_ratio"):
            values = [r.get(name) for r in timed]
            if all(v is not None for v in values):
                rec[f"process_{name}"] = values
                rec[name] = statistics.median(values)
            else:
                rec.pop(name, None)
        merged.append(rec)
    return merged


def layer_case_in_processes(
    args: argparse.Namespace, n: int, density: float, batch: int | None = None
) -> list[dict]:
    """The layer case ``n:density[:batch]`` measured in ``args.layer_processes`` fresh processes,
    one after another (:func:`layer_child_command`), merged by
    :func:`merge_process_records`. A process that fails is reported (its last line of
    error output) as a skipped record, never hidden."""
    runs = []
    k = args.layer_processes
    case = f"[layer ] n={n:5d} dens={density:<6}"
    with tempfile.TemporaryDirectory(prefix="bench_layer_") as tmp:
        for i in range(k):
            out = Path(tmp) / f"process{i}.json"
            cmd = layer_child_command(args, n, density, str(out), batch)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                tail = (done.stderr.strip().splitlines() or ["no error output"])[-1]
                why = f"process {i + 1}/{k} exited with {done.returncode}: {tail}"
                print(f"{case} {why}", flush=True)
                failed = dict(section="layer", n=n, density=density, skipped=why)
                runs.append([{**failed, "kind": kind} for kind in case_kinds(args, n)])
                continue
            recs = [r for r in json.loads(out.read_text())["results"] if r["section"] == "layer"]
            runs.append(recs)
            said = [f"{r['kind']} {_fmt(r.get('median_s', 0) * 1e3, '.1f')} ms" for r in recs]
            ratio = [r.get("median_round_ratio") for r in recs if r["kind"] == "sbm"]
            ratio = [x for x in ratio if x is not None]
            said += [f"SBM per-round ratio {ratio[0]:.3f}"] if ratio else []
            print(f"{case} process {i + 1}/{k}: {', '.join(said)}", flush=True)
    return merge_process_records(runs)


def cpu_model() -> str:
    """The CPU as the OS names it (Linux: ``/proc/cpuinfo``'s first processor, with its
    family and model numbers, which tell apart hosts that share a marketing name)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def git_commit() -> str:
    """Short hash of the checkout the benchmark ran from, ``?`` outside git."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def header(args: argparse.Namespace) -> dict[str, Any]:
    """The run's configuration and machine, as the JSON report records them."""
    from sbm_jax.kernels.cost import edge_cost

    b, h, d = args.batch, args.heads, args.head_dim
    return {
        "command": getattr(args, "command_line", ""),
        "config": {
            "batch": b,
            "heads": h,
            "head_dim": d,
            "clusters": args.clusters,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "max_gib": args.max_gib,
            "impls": args.impls,
            "heads_mode": args.heads_mode,
            "layer_options": getattr(args, "layer_options", {}),
            "layer_processes": getattr(args, "layer_processes", 0),
            "layer_dtype": jnp.dtype(layer_dtype(getattr(args, "layer_dtype", "auto"))).name,
            "baseline": baseline_options(layer_dtype(getattr(args, "layer_dtype", "auto"))),
            "peers": list(getattr(args, "peers", [])),
            "peer_sizes": list(getattr(args, "peer_sizes", [])),
            "edge_costs": {kernel: edge_cost(kernel) for kernel in ("rows", "segment")},
        },
        "machine": machine(),
    }


def machine() -> dict[str, Any]:
    """Where and on what a run measured: the JSON reports' ``machine`` record (this
    script's and ``benchmark_sparse_patterns.py``'s)."""
    return {
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(dev) for dev in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "jax": jax.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def machine_text(mach: dict[str, Any]) -> str:
    """The :func:`machine` record as both scripts' tables print it: platform, backend
    (and the device kind off CPU), CPUs and their model, JAX, date and commit. Records
    written before a field existed print ``model not recorded`` or ``?`` for it."""
    kind = mach.get("device_kind")
    device = f" ({kind})" if kind and mach["backend"] != "cpu" else ""
    return (
        f"{mach['platform']}, backend {mach['backend']}{device}, "
        f"{mach['cpu_count']} CPUs ({mach.get('cpu', 'model not recorded')}), "
        f"JAX {mach['jax']}, {mach['date']}, commit {mach.get('commit', '?')}"
    )


# ----------------------------------------------------------------------------- reporting
def _find(results, **match):
    for r in results:
        if all(r.get(k) == v for k, v in match.items()) and "median_s" in r:
            return r
    return None


def _find_any(results, **match):
    for r in results:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _exact_core(res, n):
    """The exact baseline core at ``n`` (``dense`` section), whichever implementation."""
    for r in res:
        if r.get("section") == "dense" and r.get("n") == n and "median_s" in r:
            if str(r.get("impl", "")).startswith("exact"):
                return r
    return None


def layer_label(r: dict[str, Any]) -> str:
    """How the tables name a layer record: ``full (chunked, exact baseline)``, ``full
    (xla, naive)``, ``sbm``, or the peer's registry name. (Reports written before the
    baseline was chunked name their ``full`` layer ``full (xla, naive)``.)"""
    kind = r.get("kind", "?")
    if kind == "full":
        impl = r.get("implementation")
        return f"full ({impl}, exact baseline)" if impl else "full (xla, naive)"
    if kind == "full_xla":
        return "full (xla, naive)"
    if kind == VARIANT:
        return f"sbm ({r.get('variant', '?')})"
    return str(kind)


def sampled_edges(r: dict[str, Any]) -> float | None:
    """Sampled edges of an SBM layer record over its batch and heads (every token real)."""
    if r.get("sampled_density") is None or not r.get("batch") or not r.get("heads"):
        return None
    return r["sampled_density"] * r["n"] ** 2 * r["batch"] * r["heads"]


def ratio_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per timed core/dense/layer/sample result with its ratios to the exact
    baseline (``time_vs_exact``, ``temp_vs_exact``) and to XLA's naive attention
    (``time_vs_naive``, ``temp_vs_naive``)."""
    res = report["results"]
    rows = []
    for r in res:
        if r["section"] in ("long", "lra", "calibrate"):
            continue
        naive = _find(res, section="dense", n=r["n"], impl="jax.nn.dot_product_attention")
        exact = _exact_core(res, r["n"])
        row = {
            "section": r["section"],
            "n": r["n"],
            "density": r.get("density"),
            "what": layer_label(r) if r["section"] == "layer" else r.get("impl", r.get("kind")),
        }
        if r["section"] == "layer":
            row["batch"] = r.get("batch")
        if r["section"] == "core-mem" and "temp_bytes" in r:
            row["temp_mib"] = r["temp_bytes"] / 2**20
            for key, base in (("exact", exact), ("naive", naive)):
                if base is not None and base.get("temp_bytes"):
                    row[f"temp_vs_{key}"] = r["temp_bytes"] / base["temp_bytes"]
            row["note"] = "memory only (compiled, not run), heads in one vmap"
            rows.append(row)
            continue
        if "median_s" not in r:
            row["note"] = "skipped: " + r.get("skipped", "?")
            rows.append(row)
            continue
        row["ms"] = r["median_s"] * 1e3
        row["temp_mib"] = r.get("temp_bytes", 0) / 2**20
        if r["section"] in ("core", "dense", "sample"):
            for key, base in (("exact", exact), ("naive", naive)):
                if base is not None:
                    row[f"time_vs_{key}"] = r["median_s"] / base["median_s"]
                    if base.get("temp_bytes"):
                        row[f"temp_vs_{key}"] = r.get("temp_bytes", 0) / base["temp_bytes"]
        if r["section"] == "layer":
            same = dict(section="layer", n=r["n"], density=r.get("density"))
            full = _find(res, **same, kind="full")
            xla = _find(res, **same, kind="full_xla")
            if full is not None and full.get("implementation"):  # an exact baseline
                if r is full:
                    row["time_vs_exact"] = 1.0
                elif "median_round_ratio" in r:
                    row["time_vs_exact"] = r["median_round_ratio"]
                else:
                    row["time_vs_exact"] = r["median_s"] / full["median_s"]
                if full.get("temp_bytes"):
                    row["temp_vs_exact"] = r.get("temp_bytes", 0) / full["temp_bytes"]
            naive_layer = xla or (
                full if full is not None and not full.get("implementation") else None
            )
            if naive_layer is not None:
                row["time_vs_naive"] = r["median_s"] / naive_layer["median_s"]
                if "median_round_ratio" in r and naive_layer is not full:
                    ratio = naive_layer.get("median_round_ratio")
                    if ratio:
                        row["time_vs_naive"] = r.get("median_round_ratio", 1.0) / ratio
                if naive_layer.get("temp_bytes"):
                    row["temp_vs_naive"] = r.get("temp_bytes", 0) / naive_layer["temp_bytes"]
            if r["kind"] not in SBM_KINDS:
                row["density"] = None
            edges = sampled_edges(r) if r["kind"] in SBM_KINDS else None
            if edges:
                row["bytes_per_edge"] = r.get("temp_bytes", 0) / edges
        if r["section"] == "core" and r.get("edges"):
            row["ns_per_edge"] = r["median_s"] / r["edges"] * 1e9
            row["bytes_per_edge"] = r.get("temp_bytes", 0) / r["edges"]
        if r["section"] == "layer" and "path" in r:
            row["note"] = (
                f"path {r['path']} ({_path_name(r)}), sampled density {r['sampled_density']:.3f}"
            )
            if "median_round_ratio" in r:
                row["note"] += f"; median of per-round ratios {r['median_round_ratio']:.3f}"
            ratios = r.get("process_median_round_ratio")
            if ratios:
                row["note"] += (
                    f" (the median over {len(ratios)} processes, which read "
                    f"{min(ratios):.3f}-{max(ratios):.3f})"
                )
        if r["section"] == "layer" and r.get("process_median_s"):
            ms = [t * 1e3 for t in r["process_median_s"]]
            spread = f"{len(ms)} fresh processes, {min(ms):.1f}-{max(ms):.1f} ms"
            row["note"] = f"{row['note']}; {spread}" if row.get("note") else spread
        if r["section"] == "layer" and "faults_per_call" in r:
            # (Reports written before user CPU was recorded have only the first two.)
            user = r.get("user_s_per_call")
            faults = (
                f"{r['faults_per_call']:.0f} page faults"
                + (" and " if user is None else ", ")
                + f"{r['sys_s_per_call'] * 1e3:.0f} ms system"
                + ("" if user is None else f" and {user * 1e3:.0f} ms user")
                + " CPU per call"
            )
            row["note"] = f"{row['note']}; {faults}" if row.get("note") else faults
        if r["section"] == "sample" and "median_round_ratio" in r:
            row["note"] = (
                "timed in alternation with the rows core at 5% "
                f"({r['core_median_s'] * 1e3:.1f} ms there); median of per-round ratios "
                f"{r['median_round_ratio']:.3f}"
            )
        rows.append(row)
    return rows


def _target(figure, target, value, why=""):
    return {
        "figure": figure,
        "target": target,
        "value": value,
        "met": None if value is None else value <= target,
        "note": why,
    }


def _layer_time(res, n, dd, kind):
    """A layer's time over the exact baseline's in its case (the median of the per-round
    ratios where it was timed in alternation), or None."""
    full = _find(res, section="layer", n=n, density=dd, kind="full")
    rec = _find(res, section="layer", n=n, density=dd, kind=kind)
    if full is None or rec is None or not full.get("implementation"):
        return None
    if "median_round_ratio" in rec:
        return rec["median_round_ratio"]
    return rec["median_s"] / full["median_s"]


def _layer_temp(res, n, dd, kind):
    """A layer's compiled temp bytes over the exact baseline's in its case, or None."""
    full = _find(res, section="layer", n=n, density=dd, kind="full")
    rec = _find(res, section="layer", n=n, density=dd, kind=kind)
    if full is None or rec is None or not full.get("implementation"):
        return None
    if not full.get("temp_bytes") or "temp_bytes" not in rec:
        return None
    return rec["temp_bytes"] / full["temp_bytes"]


def layer_target_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The CPU targets of whole layers (module defaults, B=2 unless stated) against the
    exact baseline measured in the same process, met or not."""
    res = report["results"]
    time = lambda n, dd, kind="sbm": _layer_time(res, n, dd, kind)
    temp = lambda n, dd, kind="sbm": _layer_temp(res, n, dd, kind)
    over = lambda a, b: None if a is None or b is None or not b else a / b
    sbm_l = _find(res, section="layer", n=16384, density=0.01, kind="sbm")
    per_edge = None
    if sbm_l is not None and sampled_edges(sbm_l) and "temp_bytes" in sbm_l:
        per_edge = sbm_l["temp_bytes"] / sampled_edges(sbm_l)
    return [
        _target("SBM 5%, n=4096: time / exact full", 0.5, time(4096, 0.05)),
        _target("SBM 5%, n=4096: temp memory / exact full", 0.6, temp(4096, 0.05)),
        _target("SBM 1%, n=4096: time / exact full", 0.2, time(4096, 0.01)),
        _target("SBM 1%, n=4096: temp memory / exact full", 0.3, temp(4096, 0.01)),
        _target(
            "SBM 1%, n=4096: time / Performer's",
            1.0,
            over(time(4096, 0.01), time(4096, 0.01, "performer")),
        ),
        _target(
            "SBM 1%, n=4096: temp memory / Performer's",
            1.0,
            over(temp(4096, 0.01), temp(4096, 0.01, "performer")),
        ),
        _target("SBM 1%, n=16384, B=1: time / exact full", 0.06, time(16384, 0.01)),
        _target("SBM 1%, n=16384, B=1: temp memory / exact full", 0.5, temp(16384, 0.01)),
        _target("SBM 1%, n=16384, B=1: compiled temp bytes per sampled edge", 32, per_edge),
        _target("SBM density 0.9, n=2048 (dense path): time / exact full", 1.5, time(2048, 0.9)),
        _target(
            "SBM density 0.9, n=2048 (dense path): temp memory / exact full",
            0.8,
            temp(2048, 0.9),
        ),
    ]


def kernel_target_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The edge-core targets at n=4096 for every kernel measured, against the exact
    baseline core (``vs_naive``: the same figure against XLA's naive attention)."""
    res = report["results"]
    n = TARGET_N
    exact = _exact_core(res, n)
    naive = _find(res, section="dense", n=n, impl="jax.nn.dot_product_attention")
    out = []
    for impl in report["config"]["impls"]:

        def core(nn_, dd, impl=impl):
            return _find(res, section="core", n=nn_, density=dd, impl=impl)

        def add(figure, target, value, alt=None, impl=impl):
            row = _target(figure, target, value)
            row.update(impl=impl, vs_naive=alt)
            out.append(row)

        c1, c5 = core(n, 0.01), core(n, 0.05)
        c2 = core(n // 2, 0.10)

        def div(a, b_, key="median_s"):
            if a is None or b_ is None or key not in a or not b_.get(key):
                return None
            return a[key] / b_[key]

        add("core fwd+bwd time / exact, density 1%", 0.10, div(c1, exact), div(c1, naive))
        add("core fwd+bwd time / exact, density 5%", 0.30, div(c5, exact), div(c5, naive))
        add(
            "core temp memory / exact, density 5%",
            0.05,
            div(c5, exact, "temp_bytes"),
            div(c5, naive, "temp_bytes"),
        )
        c5v = next(
            (
                r
                for r in res
                if r.get("section") == "core-mem"
                and r.get("n") == n
                and r.get("density") == 0.05
                and r.get("impl") == impl
                and "temp_bytes" in r
            ),
            None,
        )
        add(
            "core temp memory / exact, density 5%, heads in one vmap (as on accelerators)",
            0.05,
            div(c5v, exact, "temp_bytes"),
            div(c5v, naive, "temp_bytes"),
        )
        add("time n=2048 -> n=4096 at 205 edges/query", 2.3, div(c5, c2))
    samp = _find(res, section="sample", n=n, kind="fastRG bernoulli")
    c5 = _find(res, section="core", n=n, density=0.05, impl="rows")
    val = None
    if samp is not None and "median_round_ratio" in samp:
        val = samp["median_round_ratio"]  # timed in alternation with the core
    elif samp is not None and c5 is not None:
        val = samp["median_s"] / c5["median_s"]
    row = _target("fastRG (bernoulli) time / attention core fwd+bwd, 5%", 1.0, val)
    out.append({**row, "impl": "rows", "vs_naive": None})
    return out


def long_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Long sequences and the LRA training step: SBM run, full attention compiled."""
    rows = []
    for r in report["results"]:
        if r["section"] not in ("long", "lra"):
            continue
        full = _find_any(report["results"], section=r["section"], n=r["n"], kind="full")
        row = {
            "what": "layer fwd+bwd" if r["section"] == "long" else "LRA encoder train step",
            "n": r["n"],
            "kind": layer_label(r) if r["section"] == "long" else r["kind"],
            "batch": r.get("batch"),
            "temp_gib": r.get("temp_bytes", 0) / GIB if "temp_bytes" in r else None,
            "s": r.get("median_s"),
            "rss": r.get("peak_rss_gib"),
            "note": r.get("note", ""),
        }
        if r is not full and full is not None and full.get("temp_bytes") and "temp_bytes" in r:
            row["vs_full"] = r["temp_bytes"] / full["temp_bytes"]
        if r["kind"] == "sbm" and "sampled_density" in r:
            row["note"] = f"sampled density {r['sampled_density']:.4f}, path {r.get('path')}"
        rows.append(row)
    return rows


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def markdown(report: dict[str, Any], command: str) -> str:
    cfg, mach = report["config"], report["machine"]
    options = cfg.get("layer_options") or {}
    layer = (
        "the module's defaults"
        if not options
        else "the module's defaults but " + ", ".join(f"`{k}={v!r}`" for k, v in options.items())
    )
    base = cfg.get("baseline")
    if base:
        base_text = (
            f"the exact `full` layer with `implementation={base['implementation']!r}`"
            + (
                f" (`query_chunk={base['query_chunk']}`)"
                if "query_chunk" in base
                else " (its automatic query block, 2^19 // n queries in [16, 512])"
            )
            + ", the best exact attention on this backend"
        )
    else:
        base_text = "the `full` layer with XLA's naive attention (a report from before the "
        base_text += "exact baseline)"
    lines = [
        f"Command: `{command}`",
        "",
        *(
            [f"**Partial run** (stopped after {len(report['results'])} records).", ""]
            if report.get("partial")
            else []
        ),
        f"Machine: {machine_text(mach)}. "
        f"B={cfg['batch']} (unless stated), H={cfg['heads']}, d_h={cfg['head_dim']}, "
        f"{cfg.get('layer_dtype', 'float32')} layers, forward + backward, median of "
        f"{cfg['repeats']} after {cfg['warmup']} warm-up call(s). Every ratio divides by "
        f"{base_text}; the naive one (`jax.nn.dot_product_attention` with no "
        "implementation, `[B, H, n, n]` scores) is reported beside it. Layer rows: "
        f"`SBMAttention` with {layer}, the peers with theirs, against the same baseline "
        "(same projections), timed in alternation in one process (shuffled within each "
        "round), the padding mask and the output's cotangent passed as inputs of the "
        "compiled step (as in a training step; not constants XLA could fold); time "
        "ratios are the medians of the per-round ratios."
        + (
            f" Each layer case ran in {cfg['layer_processes']} fresh processes of its own, "
            "one after another (nothing else measured in them): a layer row's figures are "
            "the medians over those processes, its note gives their range."
            if cfg.get("layer_processes")
            else ""
        )
        + " Core rows: ratios to the exact core and to `jax.nn.dot_product_attention` at "
        "the same n.",
        "",
        "### Layer targets (CPU; whole layers, module defaults, against exact full attention)",
        "",
        "| figure | target | measured | met |",
        "|---|---|---|---|",
    ]
    for t in layer_target_rows(report):
        met = _fmt(t["met"]) if t["met"] is not None else "not measured"
        lines.append(f"| {t['figure']} | <= {t['target']} | {_fmt(t['value'])} | {met} |")
    rows = ratio_rows(report)
    layer_rows = [r for r in rows if r["section"] == "layer"]
    if layer_rows:
        lines += [
            "",
            "### Whole layers (fwd+bwd) against exact full attention",
            "",
            "| n | B | density | layer | ms | time / exact | temp MiB | temp / exact "
            "| time / naive | temp / naive | temp B/sampled edge | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in layer_rows:
            lines.append(
                f"| {r['n']} | {_fmt(r.get('batch'))} | {_fmt(r.get('density'))} | {r['what']} "
                f"| {_fmt(r.get('ms'), '.1f')} | {_fmt(r.get('time_vs_exact'))} "
                f"| {_fmt(r.get('temp_mib'), '.1f')} | {_fmt(r.get('temp_vs_exact'))} "
                f"| {_fmt(r.get('time_vs_naive'))} | {_fmt(r.get('temp_vs_naive'))} "
                f"| {_fmt(r.get('bytes_per_edge'))} | {r.get('note', '')} |"
            )
    lr = long_rows(report)
    if lr:
        lines += [
            "",
            "### Long sequences (batch 1, 2 heads; full attention compiled, not run)",
            "",
            "| what | n | attention | temp GiB | temp / exact full | one step s "
            "| peak RSS GiB | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in lr:
            lines.append(
                f"| {r['what']} | {r['n']} | {r['kind']} | {_fmt(r['temp_gib'])} "
                f"| {_fmt(r.get('vs_full'))} | {_fmt(r['s'])} | {_fmt(r['rss'])} "
                f"| {r['note']} |"
            )
    calib = [r for r in report["results"] if r["section"] == "calibrate"]
    if calib:
        lines += ["", "### Cost-model calibration", ""]
        for r in calib:
            for kernel, cost in r.get("edge_cost", {}).items():
                lines.append(
                    f"- n={r['n']}, density {r['density']}, kernel {kernel}: edge cost "
                    f"{_fmt(cost)} dense-path pairs per slot (sparse overflow: "
                    f"{r[kernel].get('overflow')}); the table in use has "
                    # Reports written before "edge_costs" hold only the rows entry.
                    f"{cfg.get('edge_costs', {}).get(kernel, cfg.get('edge_cost_rows'))}."
                )
    kt = kernel_target_rows(report)
    if any(t["value"] is not None for t in kt):
        lines += [
            "",
            "### Kernel targets (n=4096, against the exact core)",
            "",
            "| kernel | figure | target | measured | met | the same / naive XLA |",
            "|---|---|---|---|---|---|",
        ]
        for t in kt:
            met = _fmt(t["met"]) if t["met"] is not None else "not measured"
            lines.append(
                f"| {t['impl']} | {t['figure']} | <= {t['target']} | {_fmt(t['value'])} "
                f"| {met} | {_fmt(t['vs_naive'])} |"
            )
    other = [r for r in rows if r["section"] != "layer"]
    if other:
        lines += [
            "",
            "### Cores, dense attention and the sampler",
            "",
            "| section | n | density | what | ms | time / exact | time / naive | temp MiB "
            "| temp / exact | temp / naive | ns/edge | temp B/edge | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in other:
            lines.append(
                f"| {r['section']} | {r['n']} | {_fmt(r.get('density'))} | {r['what']} "
                f"| {_fmt(r.get('ms'), '.1f')} | {_fmt(r.get('time_vs_exact'))} "
                f"| {_fmt(r.get('time_vs_naive'))} "
                f"| {_fmt(r.get('temp_mib'), '.1f')} | {_fmt(r.get('temp_vs_exact'))} "
                f"| {_fmt(r.get('temp_vs_naive'))} "
                f"| {_fmt(r.get('ns_per_edge'))} | {_fmt(r.get('bytes_per_edge'))} "
                f"| {r.get('note', '')} |"
            )
    return "\n".join(lines) + "\n"


#: Markers of the block this script owns in the markdown file; text outside them (other
#: sections, hand-written notes) is kept. The older generic markers are still found.
BEGIN = "<!-- BEGIN GENERATED: scripts/benchmark_attention.py -->"
END = "<!-- END GENERATED: scripts/benchmark_attention.py -->"
_OLD_MARKERS = ("<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->")


def write_markdown(path: Path, body: str) -> None:
    """Replace this script's generated block of ``path``, keeping everything around it
    (other sections and generated blocks with other markers); append the block when the
    file has none."""
    block = f"{BEGIN}\n{body}{END}\n"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Attention benchmarks\n\n" + block)
        return
    text = path.read_text()
    for begin, end in ((BEGIN, END), _OLD_MARKERS):
        try:
            replaced = replace_block(text, begin, end, block)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        if replaced is not None:
            path.write_text(replaced)
            return
    path.write_text(text.rstrip("\n") + "\n\n" + block)


def write_section_block(path: Path, begin: str, end: str, section: str, body: str) -> None:
    """Replace the block between ``begin`` and ``end`` in ``path`` by ``body``, keeping the
    text around it; without the markers, append the ``section`` heading (when the file
    lacks it) and the block. Another script's section of docs/benchmarks.md
    (``benchmark_sparse_patterns.py``, ``stack_memory.py``) is written this way."""
    block = f"{begin}\n{body}{end}\n"
    text = path.read_text() if path.exists() else "# Attention benchmarks\n"
    try:
        replaced = replace_block(text, begin, end, block)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if replaced is None:
        if section not in text:
            text = text.rstrip("\n") + f"\n\n{section}\n\n"
        replaced = text.rstrip("\n") + "\n\n" + block
    path.write_text(replaced)


def replace_block(text: str, begin: str, end: str, block: str) -> str | None:
    """``text`` with the span from ``begin`` to ``end`` replaced by ``block`` (which
    holds its own markers) and one blank line before the prose after it; ``None``
    when ``text`` has neither marker.

    Raises:
      ValueError: the markers are unpaired (one without the other, ``end`` first) or
        repeated: replacing "from the first begin to the next end" would then delete
        text that is not the generated block (hand-written notes after an unpaired
        ``begin``, once a later run had appended a new block).
    """
    n_begin, n_end = text.count(begin), text.count(end)
    if n_begin == n_end == 0:
        return None
    if n_begin != 1 or n_end != 1 or text.index(end) < text.index(begin):
        order = "" if n_begin != 1 or n_end != 1 else ", the end before the begin"
        raise ValueError(
            f"its generated block's markers are unpaired or repeated ({n_begin} x {begin}, "
            f"{n_end} x {end}{order})"
        )
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1].lstrip("\n")
    return head + block + ("\n" + tail if tail else "")


def print_table(report: dict[str, Any]) -> None:
    head = f"{'section':7s} {'n':>5s} {'density':8s} {'what':30s} {'ms':>9s} {'/exact':>8s}"
    print(f"\n{head} {'tempMiB':>9s} {'/exact':>7s} {'/naive':>7s}")
    for r in ratio_rows(report):
        if "ms" not in r:
            dens = _fmt(r.get("density"))
            print(f"{r['section']:7s} {r['n']:5d} {dens:8s} {r['what']:30s} {r.get('note', '')}")
            continue
        print(
            f"{r['section']:7s} {r['n']:5d} {_fmt(r.get('density')):8s} {r['what']:30s} "
            f"{r['ms']:9.1f} {_fmt(r.get('time_vs_exact')):>8s} {r['temp_mib']:9.1f} "
            f"{_fmt(r.get('temp_vs_exact')):>7s} {_fmt(r.get('temp_vs_naive')):>7s}"
        )
    for r in long_rows(report):
        print(
            f"{r['what']} n={r['n']} {r['kind']}: temp {_fmt(r['temp_gib'])} GiB, "
            f"vs full {_fmt(r.get('vs_full'))}, {_fmt(r['s'])} s {r['note']}"
        )
    print("\nlayer targets (against exact full attention):")
    for t in layer_target_rows(report):
        print(f"  {t['figure']:72s} <= {t['target']:<5} {_fmt(t['value'])}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.nnx:
        args.command_line = "python scripts/benchmark_attention.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        return nnx_main(args)
    if args.from_json:
        report = args.report
    else:
        command = "python scripts/benchmark_attention.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        args.command_line = command.strip()
        report = run(args)
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    print_table(report)
    if args.markdown:
        try:
            write_markdown(Path(args.markdown), markdown(report, report.get("command", "")))
        except ValueError as err:  # markers changed by hand during the run
            script_usage.fail(f"--markdown: {err}")
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
