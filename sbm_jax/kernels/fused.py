"""The SBM layer's fused sparse path on CPU: fastRG and edge attention in one C++ kernel.

:mod:`sbm_jax.kernels.streamed` walks each graph in blocks of query rows, draws a block's
edges, attends over them and draws them again in the backward pass. This module is that
design as one native kernel per pass, for XLA:CPU through the XLA FFI
(``fused_cpu.cc`` beside this file): per query row it draws the row's edges (the layer's
Poisson row count, a key cluster and a key per draw by inverse CDF, duplicates collapsed
by a bitmap, bernoulli thinning, forced edges), attends over them in float32 and keeps
only the output and the row's log-normaliser; the backward call draws the same edges
again from counter-based random numbers (Philox4x32-10 keyed by the graph's seed and
``(row, index, stream)``) and returns the gradients of ``q``, ``k``, ``v`` and, through
the estimator ``ste``, of ``Y S`` and ``Z``. Nothing edge-sized is stored between the
passes, no capacity is reserved, and graphs run on all cores (one per thread; rows split
over the threads when there are fewer graphs than threads).

The library is compiled from source on first use with the C++ compiler on ``PATH``
(``$CXX``, else ``g++``, ``c++`` or ``clang++``) against JAX's own FFI headers
(``jax.ffi.include_dir()``), with ``-march=native`` (``$SBM_JAX_FUSED_ARCH`` overrides
it), and cached per source, flags, compiler, jaxlib and CPU under ``$SBM_JAX_CACHE``
(default ``~/.cache/sbm_jax``). Where that fails
(no compiler, another OS), :func:`fused_status` says why, ``kernel="auto"`` takes the
``rows`` kernel with one warning, and ``kernel="fused"`` is refused with the reason.
``SBM_JAX_FUSED_THREADS`` caps the threads (default: the CPUs this process may use).

The kernel is XLA:CPU only (the FFI target is registered for the ``cpu`` platform). A
GPU kernel with the same contract would replace the C++ loop nest by one program per
query tile (docs/architecture.md, "GPU and TPU paths").
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

from sbm_jax._varying import vary_like
from sbm_jax.kernels.dense import graphs_bwd, graphs_config_and_operands, graphs_fwd
from sbm_jax.kernels.rows import EDGE_KERNEL_RESIDUAL_NAMES
from sbm_jax.ste import STE_MODES

SOURCE = Path(__file__).with_name("fused_cpu.cc")
#: Compiler flags of the native library (part of the cache key), besides
#: ``-march=$SBM_JAX_FUSED_ARCH`` (default ``native``: the AVX-512 or AVX2 paths where the
#: CPU has them; e.g. ``x86-64`` builds the portable scalar paths, as the tests do).
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-pthread",
    "-DNDEBUG",
)
_TARGETS = {
    "sbm_fused_forward": "SbmFusedForward",
    "sbm_fused_backward": "SbmFusedBackward",
    "sbm_fused_graph": "SbmFusedGraph",
}
_LAWS = {"bernoulli": 0, "poisson": 1}


class FusedUnavailable(RuntimeError):
    """The fused CPU kernel cannot be built or loaded here (the message says why)."""


class _State:
    lock = threading.Lock()
    lib: ctypes.CDLL | None = None
    error: str | None = None
    tried = False


def _cache_dir() -> Path:
    base = os.environ.get("SBM_JAX_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sbm_jax"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _arch_flags() -> tuple[str, ...]:
    return (f"-march={os.environ.get('SBM_JAX_FUSED_ARCH', 'native')}",)


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def library_path() -> Path:
    """Where the compiled kernel for this source, compiler, jaxlib and CPU is cached."""
    cxx = _compiler() or "none"
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = cxx
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "ffi.h"
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join((*CXX_FLAGS, *_arch_flags())).encode(),
        version.encode(),
        header.read_bytes() if header.exists() else b"",
        _cpu_signature().encode(),
        jax.__version__.encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return _cache_dir() / f"fused_cpu-{h.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    cxx = _compiler()
    if cxx is None:
        raise FusedUnavailable(
            "no C++ compiler on PATH (set $CXX, or install g++ or clang++) to build "
            "the fused CPU kernel"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [
        cxx,
        *CXX_FLAGS,
        *_arch_flags(),
        "-isystem",
        jax.ffi.include_dir(),
        str(SOURCE),
        "-o",
        tmp,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise FusedUnavailable(
                f"building the fused CPU kernel failed ({' '.join(cmd[:2])} ...): "
                + (lines[0] if lines else f"exit status {done.returncode}")
            )
        os.replace(tmp, path)  # atomic: a concurrent build wins or loses whole
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load() -> ctypes.CDLL:
    if sys.platform not in ("linux", "darwin"):
        raise FusedUnavailable(
            f"the fused CPU kernel is built for Linux and macOS, not {sys.platform}"
        )
    path = library_path()
    if not path.exists():
        _build(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise FusedUnavailable(f"loading {path} failed: {err}") from err
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    lib.SbmFusedScratchBytes.restype = ctypes.c_int64
    lib.SbmFusedScratchBytes.argtypes = [ctypes.c_int64] * 8
    lib.SbmFusedPhaseNanos.restype = None
    lib.SbmFusedPhaseNanos.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    return lib


def load() -> ctypes.CDLL:
    """The native library, built and registered with XLA on first use; raises
    :class:`FusedUnavailable` (naming the reason) where it cannot be."""
    with _State.lock:
        if not _State.tried:
            _State.tried = True
            try:
                _State.lib = _load()
            except FusedUnavailable as err:
                _State.error = str(err)
        if _State.lib is None:
            raise FusedUnavailable(_State.error or "the fused CPU kernel is unavailable")
        return _State.lib


def fused_status() -> tuple[bool, str]:
    """``(available, reason)``: whether the fused CPU kernel builds and loads here."""
    try:
        load()
    except FusedUnavailable as err:
        return False, str(err)
    return True, "ok"


def default_threads() -> int:
    """Threads of one kernel call: ``$SBM_JAX_FUSED_THREADS``, else the CPUs this process
    may run on."""
    env = os.environ.get("SBM_JAX_FUSED_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def scratch_bytes(
    graphs: int, n: int, m: int, d: int, dv: int, kc: int, *, threads: int, backward: bool
) -> int:
    """Bytes of native scratch one call holds (outside XLA's buffers; persists in a pool
    between calls): per thread one graph's search tables and one row's buffers, plus
    key-side accumulators in a backward pass whose graphs do not divide by the threads."""
    lib = load()
    return int(lib.SbmFusedScratchBytes(graphs, n, m, d, dv, kc, threads, int(backward)))


#: The kernel's phases, in the order :func:`phase_seconds` reports them.
PHASES = ("tables", "draws", "resolve", "collapse", "sort_keys", "attend_fwd", "attend_bwd")


def phase_seconds(on: bool = True) -> dict[str, float]:
    """Seconds the kernel spent per phase (summed over threads) since the last call, and
    timing switched ``on`` or off from now (a profiling aid, scripts/profile_layer.py;
    off by default, when it costs nothing). ``draws`` includes ``resolve``."""
    lib = load()
    out = (ctypes.c_int64 * len(PHASES))()
    lib.SbmFusedPhaseNanos(int(on), out)
    return {name: out[i] * 1e-9 for i, name in enumerate(PHASES)}


class FusedConfig(NamedTuple):
    """Static settings of :func:`fused_sbm_attention`."""

    law: str  # "bernoulli" or "poisson"
    forced_half: int  # forced edges |i - j| <= forced_half on real keys; -1 for none
    dropout_rate: float
    ste: str  # "paper", "reference" or "pairs"
    probes: int  # pair probes per query row (ste="pairs")
    threads: int
    cache_slots: int = 0  # edge slots per graph kept from the forward pass; 0: none


def _attrs(cfg: FusedConfig) -> dict[str, np.generic]:
    return dict(
        law=np.int64(_LAWS[cfg.law]),
        forced_half=np.int64(cfg.forced_half),
        drop_rate=np.float32(cfg.dropout_rate),
        ste=np.int64(STE_MODES.index(cfg.ste)),
        probes=np.int64(cfg.probes),
        threads=np.int64(cfg.threads),
        cache_slots=np.int64(cfg.cache_slots),
    )


#: The kernel's operand dtypes: q, k, v, ys, z, oversample, counts, q_mask, k_mask,
#: delta, seeds, dropout seeds.
_OPERAND_DTYPES = (
    *(jnp.float32,) * 6,
    jnp.int32,
    jnp.uint8,
    jnp.uint8,
    jnp.float32,
    jnp.uint32,
    jnp.uint32,
)


def _operands(*args):
    return tuple(a.astype(t) for a, t in zip(args, _OPERAND_DTYPES, strict=True))


#: checkpoint_name of the fused kernel's edge cache, which a jax.checkpoint policy keeps
#: with the output and log-normaliser (``sbm_core.SAVED_NAMES``).
EDGE_CACHE_NAME = "sbm_fused_edge_cache"


def _cache_shapes(cfg: FusedConfig, lead: tuple[int, ...], n: int):
    """The edge cache's columns and row table (one-element placeholders without one)."""
    on = cfg.cache_slots > 0
    return (
        jax.ShapeDtypeStruct((*lead, cfg.cache_slots if on else 1), jnp.int32),
        jax.ShapeDtypeStruct((*lead, n, 2) if on else (*lead, 1, 2), jnp.int32),
    )


def _forward(cfg: FusedConfig, ops):
    """``(out, lse, edges, cache_cols, cache_rows)``: with ``cfg.cache_slots`` the edges
    of every row block that fits (``[..., slots]`` int32) and each row's ``(start,
    count)`` in them (``[..., n, 2]``; count -1 for a row not kept), else one-element
    placeholders."""
    load()
    q, v = ops[0], ops[2]
    lead = q.shape[:-2]
    shapes = (
        jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), jnp.float32),
        jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32),
        jax.ShapeDtypeStruct(lead, jnp.int32),
        *_cache_shapes(cfg, lead, q.shape[-2]),
    )
    call = jax.ffi.ffi_call("sbm_fused_forward", shapes, vmap_method="broadcast_all")
    # Inside jax.shard_map the results vary over the mesh axes the operands vary over
    # (an FFI call's results vary over none by itself).
    return vary_like(call(*ops, **_attrs(cfg)), *ops)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg, q, k, v, ys, z, c, counts, q_mask, k_mask, delta, seeds, dseeds):
    ops = _operands(q, k, v, ys, z, c, counts, q_mask, k_mask, delta, seeds, dseeds)
    out, _, edges, _, _ = _forward(cfg, ops)
    return out.astype(v.dtype), edges.astype(jnp.float32)


def _fused_fwd(cfg, *args):
    ops = _operands(*args)
    out, lse, edges, cols, kept = _forward(cfg, ops)
    # Tagged so that a jax.checkpoint policy keeps them (the edge kernels' names).
    out_name, lse_name = EDGE_KERNEL_RESIDUAL_NAMES
    out, lse = checkpoint_name(out, out_name), checkpoint_name(lse, lse_name)
    cols, kept = (checkpoint_name(a, EDGE_CACHE_NAME) for a in (cols, kept))
    v = args[2]
    return (out.astype(v.dtype), edges.astype(jnp.float32)), (args, out, lse, cols, kept)


def _fused_bwd(cfg, res, cts, *, in_place: bool = True):
    args, out, lse, cols, kept = res
    dout, dcount = cts
    f32 = jnp.float32
    ops = _operands(*args)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, f32) for a in ops[:5])
    # dq and dys are written over q and ys (rows are read before they are written, see
    # backward_block in fused_cpu.cc): two fewer buffers where XLA has no other use for
    # them (n=16384, impl="sparse": 149 -> 134 MiB of temp); XLA copies them otherwise,
    # as it does inside a lax.switch branch (hence in_place=False there).
    call = jax.ffi.ffi_call(
        "sbm_fused_backward",
        shapes,
        vmap_method="broadcast_all",
        input_output_aliases={0: 0, 3: 3} if in_place else None,
    )
    grads = call(*ops, out, lse, dout.astype(f32), dcount.astype(f32), cols, kept, **_attrs(cfg))
    # Float inputs get their gradient (zero for the oversampling and delta, which the
    # sampling reads under stop_gradient); integer ones none.
    grads = vary_like(grads, *ops, *cts)  # as _forward's results, inside jax.shard_map
    cts_in = [g.astype(a.dtype) for g, a in zip(grads, args[:5], strict=True)]
    c, delta = args[5], args[9]
    return (*cts_in, jnp.zeros_like(c), None, None, None, jnp.zeros_like(delta), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check_shapes(q, k, v, ys, z, oversample, counts, q_mask, k_mask, delta, seeds, dseeds):
    """One line naming the first operand whose shape does not fit ``q``'s graphs."""
    lead, (n, d) = q.shape[:-2], q.shape[-2:]
    m, kc = k.shape[-2], ys.shape[-1]
    want = {
        "k": (*lead, m, d),
        "v": (*lead, m, v.shape[-1]),
        "ys": (*lead, n, kc),
        "z": (*lead, m, kc),
        "oversample": (*lead, n),
        "counts": (*lead, n),
        "q_mask": (*lead, n),
        "k_mask": (*lead, m),
        "delta": tuple(lead),
        "seeds": (*lead, 2),
        "dropout_seeds": (*lead, 2),
    }
    got = dict(
        k=k, v=v, ys=ys, z=z, oversample=oversample, counts=counts, q_mask=q_mask,
        k_mask=k_mask, delta=delta, seeds=seeds, dropout_seeds=dseeds,
    )  # fmt: skip
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(
                f"fused_sbm_attention: {name} has shape {tuple(got[name].shape)}, expected "
                f"{shape} for q of shape {tuple(q.shape)}"
            )


def _check_call(cfg: FusedConfig, args: tuple) -> None:
    _check_shapes(*args)
    if cfg.cache_slots >= 2**31:  # the cache's offsets are int32
        raise ValueError(
            f"edge_cache: {cfg.cache_slots} edge slots per graph (edge_cache times the "
            f"sequence length {args[0].shape[-2]}) exceed the 2^31 - 1 the cache can address"
        )


def fused_sbm_attention(
    cfg: FusedConfig,
    seeds: jax.Array,
    dropout_seeds: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ys: jax.Array,
    z: jax.Array,
    oversample: jax.Array,
    counts: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample and attend over ``G`` graphs in one native call: ``(out, count, edges)``.

    Shapes (``...`` the graphs' batch axes): ``q [..., n, d]``, ``k [..., m, d]``,
    ``v [..., m, dv]``; ``ys [..., n, kc]`` (``Y S``) and ``z [..., m, kc]`` the masked
    memberships; ``oversample [..., n]`` the bernoulli factors ``c_i`` (1 under the
    poisson law); ``counts [..., n]`` int the Poisson draws per row; ``q_mask [..., n]``,
    ``k_mask [..., m]`` the real tokens; ``delta [...]`` the exploration; ``seeds``,
    ``dropout_seeds [..., 2]`` uint32 per graph (``jax.random.bits(key, (2,),
    jnp.uint32)``).

    ``out [..., n, dv]`` (dtype of ``v``); ``count [...]`` float32, the edges per graph,
    whose cotangent is the straight-through cotangent of every edge's mask (the density
    term) under ``ste="paper"`` and ``"reference"``, and carries none under ``"pairs"``
    (its count term is the caller's closed form); ``edges [...]`` int32.
    """
    args = (q, k, v, ys, z, oversample, counts, q_mask, k_mask, delta, seeds, dropout_seeds)
    _check_call(cfg, args)
    out, count = _fused(cfg, *args)
    if cfg.ste == "pairs":
        count = jax.lax.stop_gradient(count)
    return out, count, jax.lax.stop_gradient(count).astype(jnp.int32)


def fused_graph_masks(
    seeds: jax.Array,
    ys: jax.Array,
    z: jax.Array,
    oversample: jax.Array,
    counts: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: jax.Array,
    *,
    law: str,
    forced_half: int,
) -> jax.Array:
    """The ``[..., n, m]`` bool graphs :func:`fused_sbm_attention` draws from the same
    arguments (the same row routine): the tests' view of the kernel's edges. O(n m)."""
    load()
    args = (ys, z, oversample, counts, q_mask, k_mask, delta, seeds)
    ops = tuple(a.astype(t) for a, t in zip(args, _OPERAND_DTYPES[3:11], strict=True))
    shape = jax.ShapeDtypeStruct((*ys.shape[:-1], z.shape[-2]), jnp.uint8)
    call = jax.ffi.ffi_call("sbm_fused_graph", shape, vmap_method="broadcast_all")
    mask = call(*ops, law=np.int64(_LAWS[law]), forced_half=np.int64(forced_half))
    return mask.astype(bool)


# The fused kernel or the XLA dense path, chosen per batch, under one custom VJP. A
# ``lax.switch`` over two differentiable branches (each its own custom VJP) made every
# branch's residuals outputs of the switch, so the rematerialised forward pass returned
# fresh copies of q, k, v, Y S and Z through it (XLA cannot forward a conditional's
# operand), ~14 MiB of the layer's temp at n=4096, B=2, H=2 and ~19 MiB at n=16384. Here
# the operands are the VJP's own residuals, outside both switches (one per pass), and the
# switches carry only the branches' outputs, log-normalisers and edge cache.
def _graphs(a: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """``a [*lead, ...]`` as ``[G, ...]``, the graphs on one axis (a view, no copy)."""
    return a.reshape(-1, *a.shape[len(lead) :])


def _dense_operands(extras: tuple, fargs: tuple) -> tuple:
    """The dense path's operands ``[G, ...]`` from the fused ones and its keys and row
    offsets ``extras = (keys, drop_keys, offsets)``."""
    q, k, v, ys, z, _, _, q_mask, k_mask, delta, _, _ = fargs
    keys, drop_keys, offsets = extras
    lead = q.shape[:-2]
    qm, km = (_graphs(a, lead).astype(bool) for a in (q_mask, k_mask))
    floats = (_graphs(a, lead) for a in (q, k, v, ys, z, delta))
    return (*floats, keys, drop_keys, qm, km, offsets)


def _row_major(a: jax.Array) -> jax.Array:
    return with_layout_constraint(a, Layout(tuple(range(a.ndim))))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _switched(cfg, dense_cfg, index, fargs, extras):
    (out, count), _ = _switched_fwd(cfg, dense_cfg, index, fargs, extras)
    return out, count


def _switched_fwd(cfg, dense_cfg, index, fargs, extras):
    q = fargs[0]
    lead, n = q.shape[:-2], q.shape[-2]

    def fused(ops):
        (out, count), (_, out32, lse, cols, kept) = _fused_fwd(cfg, *ops[0])
        return out, count, out32.astype(jnp.float32), lse, cols, kept

    def dense(ops):
        (out, count), res = graphs_fwd(dense_cfg, *_dense_operands(ops[1], ops[0]))

        def shaped(a):
            return a.reshape(*lead, *a.shape[1:])

        out32, lse = shaped(res[-2]).astype(jnp.float32), shaped(res[-1])
        cols, kept = (jnp.zeros(c.shape, c.dtype) for c in _cache_shapes(cfg, lead, n))
        return shaped(out), shaped(count), out32, lse, cols, kept

    out, count, out32, lse, cols, kept = jax.lax.switch(index, [fused, dense], (fargs, extras))
    out_name, lse_name = EDGE_KERNEL_RESIDUAL_NAMES
    out32, lse = checkpoint_name(out32, out_name), checkpoint_name(lse, lse_name)
    cols, kept = (checkpoint_name(a, EDGE_CACHE_NAME) for a in (cols, kept))
    return (out, count), (index, fargs, extras, out32, lse, cols, kept)


def _switched_bwd(cfg, dense_cfg, res, cts):
    index, fargs, extras, out32, lse, cols, kept = res
    dout, dcount = cts
    lead = fargs[0].shape[:-2]

    def fused(ops):
        dc = jnp.zeros_like(dcount) if cfg.ste == "pairs" else dcount  # as fused_sbm_attention
        res = (fargs, out32, lse, cols, kept)
        return _fused_bwd(cfg, res, (dout, dc), in_place=False)[:5]

    def dense(ops):
        dres = (*_dense_operands(extras, fargs), _graphs(out32, lead), _graphs(lse, lead))
        grads = graphs_bwd(dense_cfg, dres, (_graphs(dout, lead), _graphs(dcount, lead)))[:5]
        return tuple(g.reshape(a.shape) for g, a in zip(grads, fargs[:5], strict=True))

    grads = jax.lax.switch(index, [fused, dense], None)
    c, delta = fargs[5], fargs[9]
    fcts = (*grads, jnp.zeros_like(c), None, None, None, jnp.zeros_like(delta), None, None)
    return None, fcts, (None, None, None)


_switched.defvjp(_switched_fwd, _switched_bwd)


def fused_or_dense_attention(
    cfg: FusedConfig,
    use_dense: jax.Array,
    seeds: jax.Array,
    dropout_seeds: jax.Array,
    keys: jax.Array,
    dropout_keys: jax.Array | None,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ys: jax.Array,
    z: jax.Array,
    oversample: jax.Array,
    counts: jax.Array,
    q_mask: jax.Array,
    k_mask: jax.Array,
    delta: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`fused_sbm_attention`, or where ``use_dense`` (a traced bool) is set the XLA
    dense path (:func:`sbm_jax.kernels.dense.streamed_sbm_attention_graphs` of every
    graph, drawn from ``keys`` and ``dropout_keys``, ``[...]`` PRNG keys; ``None``: no
    dropout), with the same law, estimator, forced edges and dropout rate, in both
    passes: ``(out, count, edges)`` as there. Under the ``"pairs"`` estimator the fused
    branch's count carries no cotangent (its count term is the caller's closed form) and
    the dense branch's carries its own."""
    args = (q, k, v, ys, z, oversample, counts, q_mask, k_mask, delta, seeds, dropout_seeds)
    _check_call(cfg, args)
    lead = q.shape[:-2]
    dense_cfg, dargs = graphs_config_and_operands(
        *(_graphs(a, lead) for a in (keys, q, k, v, ys, z, q_mask, k_mask, delta)),
        law=cfg.law, ste=cfg.ste,
        forced_half=None if cfg.forced_half < 0 else cfg.forced_half,
        dropout_rate=cfg.dropout_rate,
        dropout_rngs=None if dropout_keys is None else _graphs(dropout_keys, lead),
    )  # fmt: skip
    extras = (dargs[6], dargs[7], dargs[10])
    index = jnp.asarray(use_dense, jnp.int32)
    pinned = tuple(_row_major(a) for a in args)  # the FFI calls' layout, before the switch
    out, count = _switched(cfg, dense_cfg, index, pinned, extras)
    return out, count, jax.lax.stop_gradient(count).astype(jnp.int32)
