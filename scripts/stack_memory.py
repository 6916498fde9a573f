#!/usr/bin/env python
"""Memory a model pays per attention layer: XLA's compiled temp bytes of a residual
stack of L layers (``x <- x + layer(x)``), fwd+bwd under one ``jit``, for L = 1 and
``--layers``.

A one-layer benchmark (``scripts/benchmark_attention.py``) measures the layer's peak,
where its own backward pass runs. A model of several layers also holds, for every layer
whose backward pass has not run yet, what that layer keeps from its forward pass: the
per-layer increment printed here. The SBM layer rematerialises its memberships and
``Y S`` (``jax.checkpoint``, with the recomputation tied to the cotangent:
``sbm_jax/_remat.py``), so it keeps about what the exact baseline keeps.

Compile-only (nothing runs), so the figures do not drift with the machine's load. The
layers use their defaults and the exact baseline ``full`` with
``benchmark_attention.baseline_options`` (chunked on CPU). The SBM layer's sampled
density does not change XLA's temp bytes; the fused CPU kernel's native scratch (per
thread, shared by the layers one after another) is not in them.

Usage::

    python scripts/stack_memory.py --cases 4096:2 16384:1 --layers 3 --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark_attention as bench  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.attention import get_attention  # noqa: E402
from sbm_jax.attention.registry import get_mechanism  # noqa: E402


def stack_temp_bytes(kind: str, layers: int, b: int, n: int, h: int, d: int) -> int:
    """Compiled temp bytes of the fwd+bwd of ``layers`` residual ``kind`` layers."""
    fields: dict[str, Any] = dict(num_heads=h, head_dim=d, out_dim=h * d)
    if kind == "full":
        fields.update(bench.baseline_options())
    cls = get_attention(kind)

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            for _ in range(layers):
                x = x + cls(**fields)(x, mask, deterministic=False)
            return x

    model = Stack()
    x, g, mask = bench._layer_inputs(b, n, h * d)
    key = jax.random.PRNGKey(3)
    rngs = {"params": key, "sample": key, "dropout": key}
    params = jax.jit(lambda x: model.init(rngs, x, mask[:, :64]))(x[:, :64])["params"]
    params = nn.unbox(params)

    def loss(p: Any, x: jax.Array, g: jax.Array, mask: jax.Array) -> jax.Array:
        out = model.apply({"params": p}, x, mask, rngs={"sample": key, "dropout": key})
        return jnp.sum(out * g)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, g, mask).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


#: The markers of this script's block in the markdown file (text around them is kept).
BEGIN = "<!-- BEGIN GENERATED: scripts/stack_memory.py -->"
END = "<!-- END GENERATED: scripts/stack_memory.py -->"
SECTION = "## Memory per layer in a model"


def parse_case(text: str) -> tuple[int, int]:
    """``"n:batch"`` -> ``(n, batch)``, both positive; a ValueError naming ``--cases``."""
    parts = text.split(":")
    try:
        n, batch = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        n = batch = 0
    if n < 1 or batch < 1:
        raise ValueError(f"--cases: {text!r} is not n:batch with two positive integers")
    return n, batch


def report(args: argparse.Namespace, cases: list[tuple[int, int]]) -> str:
    """The table (markdown): for each ``(n, batch)`` case (``args.cases`` parsed) and
    kind, a 1-layer and an ``args.layers``-layer stack's temp MiB and the increment per
    added layer."""
    mib = 2.0**20
    lines = [
        f"Command: `python scripts/stack_memory.py --cases {' '.join(args.cases)} "
        f"--layers {args.layers} --kinds {' '.join(args.kinds)} --markdown docs/benchmarks.md`",
        "",
        f"Machine: {bench.machine_text(bench.machine())}. H={args.heads}, "
        f"d_h={args.head_dim}, float32, fwd+bwd, XLA temp MiB.",
        "",
        f"| layer | n | B | 1 layer | {args.layers} layers | per added layer |",
        "|---|---|---|---|---|---|",
    ]
    for n, batch in cases:
        for kind in args.kinds:
            print(f"compiling {kind} at n={n}, B={batch}", file=sys.stderr, flush=True)
            dims = (batch, n, args.heads, args.head_dim)
            one = stack_temp_bytes(kind, 1, *dims) / mib
            deep = stack_temp_bytes(kind, args.layers, *dims) / mib
            per_layer = (deep - one) / (args.layers - 1)
            name = (
                f"full ({bench.baseline_options()['implementation']})" if kind == "full" else kind
            )
            lines.append(f"| {name} | {n} | {batch} | {one:.1f} | {deep:.1f} | {per_layer:.1f} |")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, body: str) -> None:
    """Replace this script's block in ``path`` (or append the section and the block)."""
    bench.write_section_block(path, BEGIN, END, SECTION, body)


def add_case_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags this script and ``cost_floors.py`` share: ``--cases`` (``n:batch``, read
    with :func:`checked_cases`), ``--heads``, ``--head-dim`` and ``--markdown``."""
    ap.add_argument("--cases", nargs="+", default=["4096:2", "16384:1"], help="n:batch")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--markdown", type=Path, help="write the table into this file's block")


def checked_cases(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[int, int]]:
    """The ``(n, batch)`` of :func:`add_case_arguments`' ``--cases``, after refusing (one
    line naming the flag, before anything is measured) a bad case or a ``--markdown``
    file that cannot be written."""
    if args.markdown is not None and (why := bench.unwritable(str(args.markdown))):
        ap.error(f"--markdown: {why}")
    try:
        return [parse_case(case) for case in args.cases]
    except ValueError as err:
        ap.error(str(err))


def main(argv: list[str] | None = None) -> None:
    ap = script_usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_arguments(ap)
    ap.add_argument("--layers", type=int, default=3, help="the deeper stack (>= 2)")
    ap.add_argument("--kinds", nargs="+", default=["sbm", "full", "performer"])
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error(f"--layers must be >= 2, got {args.layers}")
    cases = checked_cases(ap, args)
    try:
        for kind in args.kinds:
            get_mechanism(kind, field="--kinds")
    except ValueError as err:
        ap.error(str(err))
    body = report(args, cases)
    print(body)
    if args.markdown is not None:
        write_markdown(args.markdown, body)


if __name__ == "__main__":
    main()
