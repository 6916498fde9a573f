#!/usr/bin/env python
"""Time and size the Sparse Transformer pattern layers against `full`, forward + backward.

Every figure is a whole registered attention layer (projections, attention, output
projection) in training mode without dropout, ``value_and_grad`` of ``sum(out * g)``
with respect to all parameters and the input, B=2, H=2, d_h=32 (width 64), float32, all
tokens real. All layers at all sequence lengths n are compiled in one process and timed
in alternation (every layer and n once per round, in an order shuffled each round), so
that the drift of a shared machine falls on every layer and n alike; each time is the
median of ``--repeats`` calls after ``--warmup``, each time ratio the median over rounds
of the ratio within a round.
Memory is XLA's compiled memory analysis: ``temp`` = scratch the program allocates
beyond its arguments and outputs. A layer whose compiled footprint exceeds
``--max-gib`` is compiled only (memory, no time).

Layers (default options unless named): ``full``; ``sparse_strided`` and
``sparse_fixed`` with ``impl="blocked"`` (the default; stride l = round(sqrt(n)),
fixed c = max(1, min(8, l // 8)), i.e. 8 from l = 64 on), bidirectional and causal;
``sparse_fixed`` with c = 8 given explicitly; and the dense-mask reference ``impl="mask"`` of
both patterns.

Usage::

    python scripts/benchmark_sparse_patterns.py                      # n = 1024 4096 16384
    python scripts/benchmark_sparse_patterns.py --sizes 1024 --repeats 3
    python scripts/benchmark_sparse_patterns.py --json out.json --markdown docs/benchmarks.md
    python scripts/benchmark_sparse_patterns.py --sizes 4096 16384 --chunk-c 8 \
        --chunk-sweep 0 4194304 1048576 262144 65536    # chunk size of the parts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_attention import (  # noqa: E402
    check_numbers,
    check_paths,
    machine,
    machine_text,
    measure_interleaved,
    write_section_block,
)

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.attention import get_attention  # noqa: E402
from sbm_jax.attention.sparse_patterns import default_stride, default_summary_cells  # noqa: E402

GIB = 2**30
TARGET_N, GROWTH_FROM, GROWTH_TO = 4096, 4096, 16384
SECTION = "## Sparse Transformer patterns"
BEGIN, END = "<!-- BEGIN SPARSE PATTERNS GENERATED -->", "<!-- END SPARSE PATTERNS GENERATED -->"

#: (label, registry name, options) of every layer measured.
LAYERS: list[tuple[str, str, dict[str, Any]]] = [
    ("full", "full", {}),
    ("strided", "sparse_strided", {}),
    ("strided causal", "sparse_strided", {"causal": True}),
    ("fixed", "sparse_fixed", {}),
    ("fixed causal", "sparse_fixed", {"causal": True}),
    ("fixed c=8", "sparse_fixed", {"c": 8}),
    ("strided mask", "sparse_strided", {"impl": "mask"}),
    ("fixed mask", "sparse_fixed", {"impl": "mask"}),
]


def layer_fwd_bwd(name: str, options: dict[str, Any], b: int, h: int, d: int, n: int):
    """``(fn, args)``: value_and_grad of sum(layer(x) * g) wrt (params, x)."""
    width = h * d
    kx, kg, kp = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (b, n, width))
    g = jax.random.normal(kg, (b, n, width))
    mask = jnp.ones((b, n), bool)
    module = get_attention(name)(num_heads=h, head_dim=d, out_dim=width, **options)
    # Parameters do not depend on n; init on 64 tokens (stride 8, room for c = 8).
    params = nn.unbox(module.init(kp, x[:, :64], mask[:, :64], deterministic=True))["params"]

    # g and the mask are arguments, not constants XLA would fold (an all-true constant
    # mask lets XLA drop `full`'s masking, which no training step gets).
    def loss(p, x, g, mask):
        out = module.apply({"params": p}, x, mask, deterministic=False)
        return jnp.sum(out * g)

    return jax.value_and_grad(loss, argnums=(0, 1)), (params, x, g, mask)


def core_fwd_bwd(kind: str, n: int, c: int | None, chunk: int, b: int, h: int, d: int):
    """``(fn, args)``: fwd+bwd of ``blocked_pattern_attention`` (l = round(sqrt n)) alone,
    wrt q, k, v, with ``chunk_elements=chunk`` (0: one chunk, i.e. unchunked)."""
    from sbm_jax.attention.sparse_blocked import blocked_pattern_attention

    stride = default_stride(n)
    c = default_summary_cells(stride) if c is None else c
    q, k, v, g = (
        jax.random.normal(key, (b, n, h, d)) for key in jax.random.split(jax.random.key(0), 4)
    )
    mask = jnp.ones((b, n), bool)

    def loss(q, k, v, g, mask):
        out, _ = blocked_pattern_attention(
            q, k, v, mask, kind=kind, stride=stride, c=c, chunk_elements=chunk or 2**62
        )
        return jnp.sum(out * g)

    return jax.value_and_grad(loss, argnums=(0, 1, 2)), (q, k, v, g, mask)


def chunk_sweep(args: argparse.Namespace) -> None:
    """Print fwd+bwd time and temp of the cores per chunk size (one alternation)."""
    loads, labels = [], []
    for kind in ("strided", "fixed"):
        for n in args.sizes:
            for chunk in args.chunk_sweep:
                h, d = args.heads, args.head_dim
                loads.append(core_fwd_bwd(kind, n, args.chunk_c, chunk, args.batch, h, d))
                labels.append((kind, n, chunk))
    infos = measure_interleaved(
        loads,
        repeats=args.repeats,
        warmup=args.warmup,
        max_bytes=args.max_gib * GIB,
        shuffle_seed=0,
    )
    print("| kind | n | chunk_elements | ms | temp MiB |\n|---|---|---|---|---|")
    for (kind, n, chunk), info in zip(labels, infos, strict=True):
        ms = _fmt(info.get("median_s", 0) * 1e3 if "median_s" in info else None, ".1f")
        mib = info["temp_bytes"] / 2**20
        print(f"| {kind} | {n} | {chunk or 'unchunked'} | {ms} | {mib:.1f} |")


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Every layer at every n in one alternation: the load of a shared machine drifts by
    # several times within minutes, so sizes timed one after the other would compare
    # different loads (the n-growth target compares n = 4096 with n = 16384).
    chosen = [row for row in LAYERS if args.layers is None or row[0] in args.layers]
    loads, results = [], []
    for n in args.sizes:
        for label, name, options in chosen:
            if "mask" in label and args.mask_max_n and n > args.mask_max_n:
                continue
            fn, fargs = layer_fwd_bwd(name, options, args.batch, args.heads, args.head_dim, n)
            loads.append((fn, fargs))
            results.append({"n": n, "layer": label, "name": name, "options": options})
    infos = measure_interleaved(
        loads,
        repeats=args.repeats,
        warmup=args.warmup,
        max_bytes=args.max_gib * GIB,
        shuffle_seed=0,
    )
    for rec, info in zip(results, infos, strict=True):
        rec.update(info)
        shown = f"{rec['median_s'] * 1e3:9.1f} ms" if "median_s" in rec else rec["skipped"]
        print(
            f"n={rec['n']:6d} {rec['layer']:15s} {shown}  temp {rec['temp_bytes'] / 2**20:.1f} MiB"
        )
    return {
        "config": {
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "max_gib": args.max_gib,
        },
        "machine": machine(),
        "results": results,
    }


def _find(results, n: int, layer: str) -> dict[str, Any] | None:
    return next((r for r in results if r["n"] == n and r["layer"] == layer), None)


def _ratio(a, b, key: str) -> float | None:
    """a / b; for times the median over rounds of a's time over b's in the same round."""
    if a is None or b is None or key not in a or key not in b or not b[key]:
        return None
    if key == "median_s":
        return statistics.median(x / y for x, y in zip(a["times_s"], b["times_s"], strict=True))
    return a[key] / b[key]


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def target_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue-18 targets for every blocked layer measured."""
    res = report["results"]
    full = _find(res, TARGET_N, "full")
    rows = []
    labels = [label for label, *_ in LAYERS if label != "full" and "mask" not in label]
    for label in labels:
        at = _find(res, TARGET_N, label)
        big = _find(res, GROWTH_TO, label)
        small = _find(res, GROWTH_FROM, label)
        if at is None and big is None:
            continue
        for figure, target, value in [
            (f"time / full, n={TARGET_N}", 0.25, _ratio(at, full, "median_s")),
            (f"temp memory / full, n={TARGET_N}", 0.1, _ratio(at, full, "temp_bytes")),
            (f"time n={GROWTH_FROM} -> {GROWTH_TO}", 9.0, _ratio(big, small, "median_s")),
        ]:
            met = None if value is None else value <= target
            rows.append(
                {"layer": label, "figure": figure, "target": target, "value": value, "met": met}
            )
    return rows


def markdown(report: dict[str, Any]) -> str:
    cfg, mach, res = report["config"], report["machine"], report["results"]
    lines = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {machine_text(mach)}. B={cfg['batch']}, "
        f"H={cfg['heads']}, d_h={cfg['head_dim']}, float32, whole layer forward + backward, "
        f"median of {cfg['repeats']} after {cfg['warmup']} warm-up call(s), timed in "
        "alternation in one process (every layer at every n once per round, order "
        "shuffled per round). Time ratios are medians over rounds of the per-round ratio; "
        "they are to the `full` layer at the same n "
        "(`jax.nn.dot_product_attention`); `time / mask` is to the same pattern's dense-mask "
        'reference (`impl="mask"`, plain XLA, faster than `full` on CPU).',
        "",
        "| n | layer | l | c | ms | time / full | time / mask | temp MiB | temp / full | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        full = _find(res, r["n"], "full")
        mask = _find(res, r["n"], r["layer"].split()[0] + " mask") if r["name"] != "full" else None
        stride = default_stride(r["n"]) if r["name"] != "full" else None
        c = (
            r["options"].get("c", default_summary_cells(stride))
            if r["name"] == "sparse_fixed"
            else None
        )
        lines.append(
            f"| {r['n']} | {r['layer']} | {stride or '-'} | {c or '-'} "
            f"| {_fmt(r.get('median_s', 0) * 1e3 if 'median_s' in r else None, '.1f')} "
            f"| {_fmt(_ratio(r, full, 'median_s'))} | {_fmt(_ratio(r, mask, 'median_s'))} "
            f"| {r['temp_bytes'] / 2**20:.1f} "
            f"| {_fmt(_ratio(r, full, 'temp_bytes'))} | {r.get('skipped', '')} |"
        )
    lines += [
        "",
        "| layer | figure | target | measured | met |",
        "|---|---|---|---|---|",
    ]
    for t in target_rows(report):
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(
            f"| {t['layer']} | {t['figure']} | <= {t['target']} | {_fmt(t['value'])} | {met} |"
        )
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, body: str) -> None:
    """Replace the generated block of the section at the end of ``path`` (or add both)."""
    write_section_block(path, BEGIN, END, SECTION, body)


def parse_args(argv=None) -> argparse.Namespace:
    p = script_usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument(
        "--layers",
        nargs="+",
        default=None,
        choices=[label for label, *_ in LAYERS],
        metavar="LABEL",
        help="layers to run (default all): " + ", ".join(label for label, *_ in LAYERS),
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-gib", type=float, default=6.0, help="compile only above this")
    p.add_argument("--mask-max-n", type=int, default=0, help="mask layers only up to n (0: all)")
    p.add_argument("--json", default="/tmp/benchmark_sparse_patterns.json")
    p.add_argument("--markdown", default=None, help="write the table into this file")
    p.add_argument("--from-json", default=None, help="report a saved run, measure nothing")
    p.add_argument(
        "--chunk-sweep",
        type=int,
        nargs="+",
        default=None,
        help="instead: time the cores alone at these chunk_elements (0 = unchunked)",
    )
    p.add_argument("--chunk-c", type=int, default=None, help="fixed c for --chunk-sweep")
    args = p.parse_args(argv)
    if args.chunk_sweep and args.from_json:
        p.error("--chunk-sweep measures the cores; --from-json measures nothing: give one")
    # --repeats: the medians need one call per round at least (benchmark_attention asks
    # for 5; the usage above shows fewer for a quick look).
    check_numbers(
        p,
        args,
        positive=("sizes", "batch", "heads", "head_dim", "repeats", "max_gib", "chunk_c"),
        non_negative=("warmup", "mask_max_n", "chunk_sweep"),
    )
    check_paths(p, args, markers=((BEGIN, END),))
    missing = [k for k in ("config", "machine", "command") if k not in getattr(args, "report", {})]
    if args.from_json and missing:
        p.error(f"--from-json {args.from_json!r}: not a report of this script (no {missing[0]!r})")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.chunk_sweep:
        chunk_sweep(args)
        return
    if args.from_json:
        report = args.report
    else:
        report = run(args)
        report["command"] = "python scripts/benchmark_sparse_patterns.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    body = markdown(report)
    print(body)
    if args.markdown:
        try:
            write_markdown(Path(args.markdown), body)
        except ValueError as err:  # markers changed by hand during the run
            script_usage.fail(f"--markdown: {err}")
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
