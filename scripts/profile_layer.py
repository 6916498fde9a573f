#!/usr/bin/env python
"""Where the SBM layer's time goes: an XLA trace of its fwd+bwd, summed by part.

Runs the same workload as ``scripts/benchmark_attention.py``'s layer rows (the whole
``SBMAttention`` layer with the module's defaults, parameters shifted to the requested
density, gradients for all parameters and x), traces ``--repeats`` calls with
``jax.profiler``, and sums the device time of every XLA operation by the part of the
layer it belongs to. The parts are the named scopes of ``sbm_jax/_scopes.py``
(memberships, plan, fastRG, edge kernel, straight-through backward, dense path); an
operation is counted as backward when it comes from the transpose of the forward pass
or from a custom VJP's backward rule.

Times are the sum over operations, per call: on a multi-core CPU XLA runs independent
operations at once, so the sum can exceed the wall time (both are printed). An
operation XLA created without source metadata (the batched dots of the ``rows`` kernel's
einsums, some copies) is counted with the first operation that uses it and has some;
those that still have none are listed as ``unattributed``.

Usage::

    python scripts/profile_layer.py --n 4096 --density 0.05
    python scripts/profile_layer.py --n 1024 --density 0.05 --top 20 --json prof.json
    python scripts/profile_layer.py --kind full --n 4096      # the full-attention layer

Nothing here is CPU-specific; on GPU the trace holds the kernels' device times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_attention as bench  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax._scopes import PARTS, STE_BACKWARD  # noqa: E402

REST = "rest of the layer"  # projections, output, sowing, glue between the parts
UNATTRIBUTED = "unattributed"  # operations without source metadata
#: HLO opcodes that only hold other operations: their time is their children's.
CONTAINERS = {"while", "conditional", "call", "tuple", "get-tuple-element", "parameter"}

_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")


def hlo_op_names(hlo_text: str) -> dict[str, tuple[str, str]]:
    """``{instruction: (opcode, op_name)}`` from a compiled module's text.

    An instruction without an ``op_name`` takes that of its first user that has one
    (through chains of such instructions): XLA drops the metadata on some instructions
    it creates, e.g. the batched ``dot`` of an einsum, whose only user is the fusion
    that reads it (at n=4096 the ``rows`` kernel's five such dots took ~66 ms per call,
    which were listed as unattributed before)."""
    table: dict[str, tuple[str, str]] = {}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            name = _OP_NAME.search(line)
            table[m.group(1)] = (m.group(2), name.group(1) if name else "")
            for operand in _OPERAND.findall(line[m.end() :].split(", metadata=")[0]):
                users[operand].append(m.group(1))
    changed = True
    while changed:
        changed = False
        for inst, (code, name) in table.items():
            if not name:
                named = [table[u][1] for u in users.get(inst, ()) if u in table and table[u][1]]
                if named:
                    table[inst] = (code, named[0])
                    changed = True
    return table


def part_of(op_name: str) -> str:
    """The innermost named scope of :data:`PARTS` in an ``op_name`` path."""
    if not op_name:
        return UNATTRIBUTED
    best, where = REST, -1
    for part in PARTS:
        at = op_name.rfind(part)
        if at > where:
            best, where = part, at
    return best


def is_backward(op_name: str, part: str) -> bool:
    return part == STE_BACKWARD or "transpose(" in op_name or "_bwd" in op_name


def read_trace(trace_dir: str) -> list[dict[str, Any]]:
    files = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(max(files, key=lambda f: Path(f).stat().st_mtime)) as fh:
        trace = json.load(fh)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def summarize(events, table, calls: int, top: int = 0) -> dict[str, Any]:
    """Per part and direction, the summed operation time per call (ms)."""
    by_part: dict[tuple[str, str], float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") != "X":
            continue
        op = e.get("args", {}).get("hlo_op")
        if op is None or op not in table or table[op][0] in CONTAINERS:
            continue
        opcode, name = table[op]
        part = part_of(name)
        direction = "backward" if is_backward(name, part) else "forward"
        ms = e.get("dur", 0.0) / 1e3 / calls
        by_part[(part, direction)] += ms
        by_op[f"{op} ({opcode}) {name[-90:]}"] += ms
    total = sum(by_part.values())
    rows = []
    for part in (*PARTS, REST, UNATTRIBUTED):
        fwd, bwd = by_part.get((part, "forward"), 0.0), by_part.get((part, "backward"), 0.0)
        if fwd or bwd:
            share = (fwd + bwd) / total if total else 0.0
            rows.append({"part": part, "forward_ms": fwd, "backward_ms": bwd, "share": share})
    ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return {"op_time_ms": total, "parts": rows, "top_ops": [{"op": k, "ms": v} for k, v in ops]}


def profile(args: argparse.Namespace) -> dict[str, Any]:
    fn, fn_args, info = bench.layer_workload(
        args.kind, args.batch, args.heads, args.head_dim, args.n, args.density, args.options
    )
    compiled = jax.jit(fn).lower(*fn_args).compile()
    table = hlo_op_names(compiled.as_text())
    jax.block_until_ready(compiled(*fn_args))  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*fn_args))
        times.append(time.perf_counter() - t)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="sbm-profile-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(args.repeats):
        jax.block_until_ready(compiled(*fn_args))
    jax.profiler.stop_trace()
    report = summarize(read_trace(trace_dir), table, args.repeats, args.top)
    report.update(
        kind=args.kind,
        n=args.n,
        density=args.density,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        wall_ms=statistics.median(times) * 1e3,
        backend=jax.default_backend(),
        trace_dir=trace_dir,
        info={k: v for k, v in info.items() if isinstance(v, int | float | bool | str)},
    )
    return report


def print_report(report: dict[str, Any]) -> None:
    info = report["info"]
    extra = ""
    if "sampled_density" in info:
        extra = f", sampled density {info['sampled_density']:.3f}, path {info.get('path')}"
    print(
        f"{report['kind']} layer, n={report['n']}, B={report['batch']}, H={report['heads']}, "
        f"d_h={report['head_dim']}, fwd+bwd on {report['backend']}{extra}"
    )
    print(
        f"wall {report['wall_ms']:.1f} ms per call; operations sum to "
        f"{report['op_time_ms']:.1f} ms (concurrent operations overlap)"
    )
    print(f"{'part':<20} {'forward ms':>11} {'backward ms':>12} {'share':>7}")
    for row in report["parts"]:
        print(
            f"{row['part']:<20} {row['forward_ms']:>11.1f} {row['backward_ms']:>12.1f} "
            f"{row['share']:>7.1%}"
        )
    if report["top_ops"]:
        print("\nlargest operations (ms per call):")
        for op in report["top_ops"]:
            print(f"{op['ms']:9.2f}  {op['op']}")


def parse_args(argv=None) -> argparse.Namespace:
    p = script_usage.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["sbm", "full"], default="sbm")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed calls, then traced calls")
    p.add_argument("--top", type=int, default=0, help="also list the N largest operations")
    p.add_argument(
        "--layer-options",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="SBMAttention fields instead of the module's defaults (as in the benchmark)",
    )
    p.add_argument("--trace-dir", default=None, help="keep the trace here (default: temp)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 0.0 < args.density <= 1.0:
        p.error(f"--density must lie in (0, 1], got {args.density}")
    bench.check_numbers(
        p, args, positive=("n", "batch", "heads", "head_dim"), non_negative=("top",)
    )
    if args.trace_dir is not None:
        if not args.trace_dir:
            p.error("--trace-dir is empty; leave it out for a temporary folder")
        if os.path.exists(args.trace_dir) and not os.path.isdir(args.trace_dir):
            p.error(f"--trace-dir {args.trace_dir!r} is a file, not a folder")
    bench.check_paths(p, args)  # --json: written after the profile, checked now
    try:
        args.options = bench.layer_options(args.layer_options) or None
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    report = profile(args)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
