#!/usr/bin/env python
"""What a layer costs before any edge: the floors under the cost targets of SBM attention.

Times and compiled temp bytes of whole layers (fwd+bwd under one ``jit``, gradients for
all parameters and x: the workload of ``scripts/benchmark_attention.py``'s layer rows),
in alternation in one process, for each ``--cases`` length and batch:

* ``exact``: the ``full`` layer with the best exact attention on the backend
  (``benchmark_attention.baseline_options``: chunked on CPU), the baseline of every ratio;
* ``projections only``: the same ``full`` layer with its attention replaced by an
  elementwise ``O(n d)`` stand-in (``v + q * k``): the query, key, value and output
  projections and their gradients, which any attention layer of this shape holds and
  runs. No attention core, however cheap, takes a layer below this row;
* ``SBM before any edge``: the ``SBMAttention`` layer with its module defaults and its
  sampling and attention core replaced by an ``O(n k)`` stand-in (each token's own pair,
  ``v + q * p_ii`` with ``p_ii = (Y S)_i . z_i``). Everything else is the layer's own
  code: projections, the membership MLP, ``Y``, ``Z`` and ``Y S`` ([B, H, n, k] each,
  eqs. 5-7), the recomputation in the backward pass and the gradients through them. It
  is what the layer as the paper defines it pays before it samples or attends to a single
  edge;
* ``SBM``: the layer itself at ``--density`` (module defaults; on CPU the fused kernel,
  whose native scratch is counted in its temp bytes).

The stand-ins replace module-level functions only while this script traces its own
workloads (``stand_in``); the library is untouched. Everything runs on any backend.

Usage::

    python scripts/cost_floors.py --cases 4096:2 16384:1 --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark_attention as bench  # noqa: E402
from stack_memory import add_case_arguments, checked_cases  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.attention import full as full_module  # noqa: E402
from sbm_jax.attention import sbm as sbm_module  # noqa: E402

#: The markers of this script's block in the markdown file (text around them is kept).
BEGIN = "<!-- BEGIN GENERATED: scripts/cost_floors.py -->"
END = "<!-- END GENERATED: scripts/cost_floors.py -->"
SECTION = "## What a layer costs before any edge"

#: Row labels, in the order of the table.
EXACT = "exact"
PROJECTIONS = "projections only"
NO_EDGES = "SBM before any edge"
SBM = "SBM"


@contextlib.contextmanager
def stand_in(module: Any, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    """``module.name`` is ``fn`` inside the block, and what it was after it."""
    old = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, old)


def elementwise_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, **_: Any):
    """``full``'s attention replaced by ``v + q * k`` (``[B, L, H, hd]``): it reads the
    three projections, so all of them and their gradients stay in the program."""
    return v + q * k


def own_pair_core(
    rng: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_memberships: jax.Array,
    block: jax.Array,
    k_memberships: jax.Array,
    mask: jax.Array,
    **_: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SBM's sampling and attention replaced by each token's own pair: ``Y S`` as the core
    forms it, ``p_ii = (Y S)_i . z_i``, ``out = v + q * p_ii``, so that ``Y S`` and ``Z``
    (and through them ``Y``, the MLP and the clusters) get gradients as in the layer.
    Stats of the layer's shapes: density ``mean_i p_ii`` over the real tokens."""
    del rng
    per_example = jnp.broadcast_to(block, (mask.shape[0], *block.shape))
    ys = jnp.einsum("bhik,bhkl->bhil", q_memberships, per_example)
    p_own = jnp.sum(ys * k_memberships, axis=-1)  # [B, H, L]
    real = mask[:, None, :].astype(p_own.dtype)
    out = v + q * (p_own * real)[..., None]
    batch, heads = p_own.shape[:2]
    density = jnp.sum(p_own * real, axis=-1) / jnp.maximum(jnp.sum(real, axis=-1), 1.0)
    stats = {
        "density": density,
        "edges": jnp.zeros((batch, heads), jnp.float32),
        "overflow": jnp.zeros((batch, heads), bool),
        "path": jnp.zeros((), jnp.int32),
    }
    return out, stats


def traced_with(
    fn: Callable[..., Any], module: Any, name: str, core: Callable[..., Any]
) -> Callable[..., Any]:
    """``fn`` with ``module.name`` replaced by ``core`` while it is traced (under ``jit``
    it is traced once, when compiled)."""

    def wrapped(*args: Any) -> Any:
        with stand_in(module, name, core):
            return fn(*args)

    return wrapped


def workloads(
    n: int, batch: int, heads: int, head_dim: int, density: float
) -> list[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
    """``(label, fn, args, info)`` of the four rows at one case, the exact layer first."""
    dims = (batch, heads, head_dim, n)
    exact_fn, exact_args, exact_info = bench.layer_workload("full", *dims, density)
    proj_fn, proj_args, proj_info = bench.layer_workload(
        "full", *dims, density, options={"implementation": "chunked"}
    )
    proj_fn = traced_with(proj_fn, full_module, "chunked_attention", elementwise_core)
    # shift=0.0: the stand-in samples nothing, so the density calibration is not needed.
    bare_fn, bare_args, bare_info = bench.layer_workload("sbm", *dims, density, shift=0.0)
    bare_info = {"kernel": "none (stand-in core)"}  # no kernel, no native scratch
    bare_fn = traced_with(bare_fn, sbm_module, "sbm_attention_core", own_pair_core)
    sbm_fn, sbm_args, sbm_info = bench.layer_workload("sbm", *dims, density)
    return [
        (EXACT, exact_fn, exact_args, exact_info),
        (PROJECTIONS, proj_fn, proj_args, proj_info),
        (NO_EDGES, bare_fn, bare_args, bare_info),
        (SBM, sbm_fn, sbm_args, sbm_info),
    ]


def measure_case(
    n: int, batch: int, heads: int, head_dim: int, density: float, repeats: int
) -> list[dict[str, Any]]:
    """The four rows of one case: label, median ms, temp bytes (native scratch included),
    and both as ratios to the exact row (time: the median of the per-round ratios)."""
    rows = workloads(n, batch, heads, head_dim, density)
    infos = bench.measure_interleaved(
        [(fn, args) for _, fn, args, _ in rows],
        repeats=repeats,
        warmup=1,
        max_bytes=float("inf"),
        shuffle_seed=0,
    )
    out = []
    for (label, _, _, extra), info in zip(rows, infos, strict=True):
        rec = bench.with_native_scratch({**extra, **info})
        out.append({"label": label, "n": n, "batch": batch, **rec})
    exact = out[0]
    for rec in out:
        rec["time_ratio"] = rec.get("median_round_ratio", 1.0)
        rec["temp_ratio"] = rec["temp_bytes"] / exact["temp_bytes"]
    return out


def report(args: argparse.Namespace, results: list[list[dict[str, Any]]]) -> str:
    """The markdown table of every case's rows."""
    mib = 2.0**20
    lines = [
        f"Command: `python scripts/cost_floors.py --cases {' '.join(args.cases)} "
        f"--density {args.density} --repeats {args.repeats} --markdown docs/benchmarks.md`",
        "",
        f"Machine: {bench.machine_text(bench.machine())}. H={args.heads}, "
        f"d_h={args.head_dim}, k=128, float32, fwd+bwd, median of {args.repeats} calls in "
        "alternation (shuffled within each round); time ratios are the medians of the "
        "per-round ratios. `SBM` runs at the sampled density in its note.",
        "",
        "| n | B | layer | ms | time / exact | temp MiB | temp / exact | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in results:
        for rec in case:
            note = ""
            if rec["label"] == EXACT:
                note = f"`full`, implementation={rec.get('implementation')!r}"
            elif rec["label"] == SBM and "sampled_density" in rec:
                note = f"sampled density {rec['sampled_density']:.3f}, kernel {rec.get('kernel')}"
            lines.append(
                f"| {rec['n']} | {rec['batch']} | {rec['label']} | {1e3 * rec['median_s']:.1f} "
                f"| {rec['time_ratio']:.3f} | {rec['temp_bytes'] / mib:.1f} "
                f"| {rec['temp_ratio']:.3f} | {note} |"
            )
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, body: str) -> None:
    """Replace this script's block in ``path`` (or append the section and the block)."""
    bench.write_section_block(path, BEGIN, END, SECTION, body)


def main(argv: list[str] | None = None) -> None:
    ap = script_usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_arguments(ap)
    ap.add_argument("--density", type=float, default=0.01, help="the SBM row's density")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if not 0.0 < args.density < 1.0:
        ap.error(f"--density must lie in (0, 1), got {args.density}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    cases = checked_cases(ap, args)
    results = []
    for n, batch in cases:
        print(f"measuring n={n}, B={batch}", file=sys.stderr, flush=True)
        results.append(
            measure_case(n, batch, args.heads, args.head_dim, args.density, args.repeats)
        )
    body = report(args, results)
    print(body)
    if args.markdown is not None:
        write_markdown(args.markdown, body)


if __name__ == "__main__":
    main()
