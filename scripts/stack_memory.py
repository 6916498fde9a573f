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

    python scripts/stack_memory.py --n 4096 --batch 2 --layers 4 --markdown docs/benchmarks.md
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


def report(args: argparse.Namespace) -> str:
    """The table (markdown): for each kind, a 1-layer and an ``args.layers``-layer
    stack's temp MiB and the increment per added layer."""
    mib = 2.0**20
    dims = (args.batch, args.n, args.heads, args.head_dim)
    lines = [
        f"Command: `python scripts/stack_memory.py --n {args.n} --batch {args.batch} "
        f"--layers {args.layers} --kinds {' '.join(args.kinds)}`",
        "",
        f"Machine: {bench.machine_text(bench.machine())}. n={args.n}, B={args.batch}, "
        f"H={args.heads}, d_h={args.head_dim}, float32, fwd+bwd, XLA temp MiB.",
        "",
        f"| layer | 1 layer | {args.layers} layers | per added layer |",
        "|---|---|---|---|",
    ]
    for kind in args.kinds:
        print(f"compiling {kind}: 1 and {args.layers} layers", file=sys.stderr, flush=True)
        one = stack_temp_bytes(kind, 1, *dims) / mib
        deep = stack_temp_bytes(kind, args.layers, *dims) / mib
        name = f"full ({bench.baseline_options()['implementation']})" if kind == "full" else kind
        lines.append(
            f"| {name} | {one:.1f} | {deep:.1f} | {(deep - one) / (args.layers - 1):.1f} |"
        )
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, body: str) -> None:
    """Replace this script's block in ``path`` (or append the section and the block)."""
    block = f"{BEGIN}\n{body}{END}\n"
    text = path.read_text() if path.exists() else "# Attention benchmarks\n"
    try:
        replaced = bench.replace_block(text, BEGIN, END, block)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if replaced is None:
        if SECTION not in text:
            text = text.rstrip("\n") + f"\n\n{SECTION}\n\n"
        replaced = text.rstrip("\n") + "\n\n" + block
    path.write_text(replaced)


def main(argv: list[str] | None = None) -> None:
    ap = script_usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4, help="the deeper stack (>= 2)")
    ap.add_argument("--kinds", nargs="+", default=["sbm", "full", "performer"])
    ap.add_argument("--markdown", type=Path, help="write the table into this file's block")
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error(f"--layers must be >= 2, got {args.layers}")
    for kind in args.kinds:
        try:
            get_mechanism(kind, field="--kinds")
        except ValueError as err:
            ap.error(str(err))
    body = report(args)
    print(body)
    if args.markdown is not None:
        write_markdown(args.markdown, body)


if __name__ == "__main__":
    main()
