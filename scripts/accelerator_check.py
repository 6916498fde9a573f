"""One prepared device check: the ``accelerator`` tests, then the GPU table (JSON + markdown).

On one H100/H200 it fits in about 8 minutes (``--budget-s``, default 450 s, for the
tests and every case together):

1. ``pytest -m accelerator tests/test_accelerator.py`` (the layer against the dense
   reference at GPU scale, the ``triton`` kernel's hardware atomics against the segment
   reference), its log kept.
2. The table, fwd+bwd, in ``--dtypes`` (bf16, float32), at ``n`` in ``--lengths``
   (4096, 16384, 32768), density in ``--densities`` (1%, 5%), for the shapes
   ``B=2 H=2 d_h=32`` and ``B=1 H=8 d_h=64``:

   * ``sbm/<kernel>``: the SBM attention core (fastRG sampling, edge list, edge kernel,
     straight-through estimator; ``impl="sparse"``, one bucket of 1.5x the density)
     for every edge kernel (``rows``, ``segment``, ``triton``);
   * ``edge/<kernel>``: the edge kernel alone on one uniform graph of that density
     shared by every (example, head);
   * ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (flash
     attention; bf16 only: float32 is recorded as skipped with the reason);
   * ``xla``: the same call with ``implementation="xla"`` (naive full attention);
   * ``flex``: PyTorch FlexAttention with a block mask of the same uniform graph, where
     torch with CUDA is importable (else skipped, with the reason);
   * ``lra_step/<mechanism>``: one training step of the LRA encoder (Pathfinder config,
     paper scale) at n=16384, SBM and full (needs ``ml_collections``, which the device
     does not have: the device command carries it, else the case is skipped).

Every case runs in a worker process under its own time budget: a case that fails,
runs out of memory or overruns its budget is recorded with the reason (the worker is
restarted for the next one), and the cases the overall budget leaves no time for are
recorded as skipped. Cases run in priority order: the issue's target figures first.

    python scripts/accelerator_check.py --out /tmp/accel        # on the device
    python scripts/accelerator_check.py --tiny --out /tmp/accel # CPU rehearsal (tests)

Writes ``accelerator_table.json``, ``accelerator_table.md`` and ``accelerator_tests.log``
under ``--out``.

The device has JAX, Triton, PyTorch and flax but neither ``ml_collections`` (the LRA
configs) nor, perhaps, pytest: carry them as pure-Python packages in an ignored folder,
prepared once in the checkout that travels::

    SP=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p .device_py
    cp -r $SP/{ml_collections,pytest,_pytest,pluggy,iniconfig,packaging,py.py} .device_py/
    grep -qx /.device_py/ .git/info/exclude || echo /.device_py/ >>.git/info/exclude

and run (``carry=[".device_py"]``, ``timeout_s=420``; the budget leaves the rest of a
15-minute lease for one rerun of what did not fit, e.g. ``--skip-tests --lengths 32768``)::

    mkdir -p $OUT/accel; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.device_py
    timeout 400 python scripts/accelerator_check.py --out $OUT/accel --budget-s 330 \
        2>&1 | tee $OUT/accel/console.log
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's sbm_jax and configs, not an installed copy
KERNELS = ("rows", "segment", "triton")
FULL_SHAPES = ((2, 2, 32), (1, 8, 64))
TINY_SHAPES = ((1, 2, 8),)
#: Within a priority group: the references, the GPU kernel, then the portable ones.
KIND_ORDER = ("cudnn", "xla", "sbm/triton", "edge/triton", "sbm/rows", "edge/rows", "flex",
              "sbm/segment", "edge/segment")  # fmt: skip


# ----------------------------------------------------------------------------- the cases


def build_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of the table, in priority order (targets first, then the grid)."""
    shapes = TINY_SHAPES if args.tiny else FULL_SHAPES
    grid = []
    for b, h, d in shapes:
        for n in args.lengths:
            for dens in args.densities:
                for dtype in args.dtypes:
                    base = {"b": b, "h": h, "d": d, "n": n, "density": dens, "dtype": dtype}
                    for kind in ("cudnn", "xla", "flex"):
                        grid.append({**base, "kind": kind})
                    for kernel in KERNELS:
                        grid.append({**base, "kind": f"sbm/{kernel}"})
                        grid.append({**base, "kind": f"edge/{kernel}"})

    def priority(c):
        target = {
            (1, 8, 64, 32768, 0.01),
            (1, 8, 64, 16384, 0.01),
            (2, 2, 32, 4096, 0.05),
        }
        key = (c["b"], c["h"], c["d"], c["n"], c["density"])
        return (
            0 if key in target and c["dtype"] == "bf16" else 1,
            c["dtype"] != "bf16",
            c["n"],
            KIND_ORDER.index(c["kind"]),
        )

    grid.sort(key=priority)
    lra_n = args.lengths[0] if args.tiny else 16384
    lra = [
        {"kind": f"lra_step/{m}", "n": lra_n, "b": 1, "dtype": "float32"} for m in ("sbm", "full")
    ]
    # the LRA steps after the target cases, before the rest of the grid
    first = sum(1 for c in grid if priority(c)[0] == 0)
    return grid[:first] + lra + grid[first:]


def case_budget(case: dict[str, Any], tiny: bool, override: float | None = None) -> float:
    """Seconds one case may take, compilation included."""
    if override is not None:
        return override
    if tiny:
        return 60.0
    if case["kind"].startswith("lra_step"):
        return 90.0
    scale = case["n"] / 4096
    return 20.0 + 4.0 * scale


# ----------------------------------------------------------------------- the worker side


def _timeit(fn, args, min_reps: int = 3, max_s: float = 2.0, keep=None) -> dict[str, Any]:
    """Compile ``fn`` once, call it once, then time calls; ``keep(out)`` of the first
    call's output joins the record (statistics without a second compilation)."""
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    first = jax.block_until_ready(compiled(*args))
    kept = keep(first) if keep else {}
    del first
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < max_s and len(times) < 20):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    times.sort()
    return {"ms": 1e3 * times[len(times) // 2], "min_ms": 1e3 * times[0], "compile_s": compile_s,
            "reps": len(times), **kept}  # fmt: skip


def uniform_graph(n: int, density: float, seed: int = 0):
    """A row-sorted EdgeList of ``~density n^2`` uniform edges (and its numpy rows/cols)."""
    import jax.numpy as jnp
    import numpy as np

    from sbm_jax.graph import EdgeList

    rng = np.random.default_rng(seed)
    cap = max(1, math.ceil(density * n * n))
    keys = np.unique(rng.integers(0, n * n, size=cap, dtype=np.int64))
    e = len(keys)
    rows, cols = (keys // n).astype(np.int32), (keys % n).astype(np.int32)
    pad = cap - e
    edges = EdgeList(
        rows=jnp.asarray(np.concatenate([rows, np.full(pad, n - 1, np.int32)])),
        cols=jnp.asarray(np.concatenate([cols, np.zeros(pad, np.int32)])),
        valid=jnp.asarray(np.arange(cap) < e),
        probs=jnp.zeros((cap,), jnp.float32),
        num_edges=jnp.int32(e),
        num_rows=n,
        num_cols=n,
    )
    return edges, rows, cols


def _qkv(b, h, n, d, dtype, layout="bhnd"):
    import jax
    import jax.numpy as jnp

    shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    return [jax.random.normal(kk, shape, jnp.float32).astype(dt) for kk in ks]


def run_flash(case, implementation):
    import jax
    import jax.numpy as jnp

    if implementation == "cudnn" and case["dtype"] != "bf16":
        return {"status": "skipped", "note": "cuDNN flash attention runs bf16/fp16 only"}
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        return {
            "status": "skipped",
            "note": f"cuDNN needs a CUDA GPU (backend {jax.default_backend()!r})",
        }
    q, k, v, g = _qkv(case["b"], case["h"], case["n"], case["d"], case["dtype"], "bnhd")

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    return _timeit(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v))


def run_edge(case, kernel):
    import jax
    import jax.numpy as jnp

    from sbm_jax.edge_ops import edge_attention

    if kernel == "triton":
        from sbm_jax.kernels.triton import check_backend

        check_backend()
    edges, _, _ = uniform_graph(case["n"], case["density"])
    q, k, v, g = _qkv(case["b"], case["h"], case["n"], case["d"], case["dtype"])
    scale = jnp.ones((edges.capacity,), jnp.float32)

    def head(q, k, v):
        return edge_attention(q, k, v, edges, edge_scale=scale, impl=kernel)

    def loss(q, k, v):
        out = jax.vmap(jax.vmap(head))(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    res = _timeit(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v))
    res["edges"] = int(edges.num_edges)
    return res


def run_sbm(case, kernel):
    import jax
    import jax.numpy as jnp

    from sbm_jax.attention.sbm import sbm_attention_core

    b, h, n, d, dens = case["b"], case["h"], case["n"], case["d"], case["density"]
    kc = 16
    q, k, v, g = _qkv(b, h, n, d, case["dtype"])
    ks = jax.random.split(jax.random.PRNGKey(1), 2)
    # E[p_ij] = sum_ab E[y_ia] S_ab E[z_jb] = density with y, z ~ U(0, 2/k), S = density.
    qm = jax.random.uniform(ks[0], (b, h, n, kc), maxval=2.0 / kc)
    km = jax.random.uniform(ks[1], (b, h, n, kc), maxval=2.0 / kc)
    blk = jnp.full((h, kc, kc), dens, jnp.float32)
    mask = jnp.ones((b, n), bool)

    def loss(q, k, v, qm, blk, km):
        out, st = sbm_attention_core(
            jax.random.PRNGKey(2), q, k, v, qm, blk, km, mask,
            delta=0.0, capacity_buckets=(min(1.0, 1.5 * dens),), impl="sparse",
            kernel=kernel, max_dense_elements=1, max_edge_slots=2**40,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), st

    fn = jax.grad(loss, argnums=range(6), has_aux=True)
    args = (q, k, v, qm, blk, km)

    def keep(out):
        st = out[1]
        return {
            "sampled_density": float(jnp.mean(st["density"])),
            "overflow": int(jnp.sum(st["overflow"])),
        }

    return _timeit(fn, args, keep=keep)


def run_flex(case):
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as err:  # noqa: BLE001 - any import failure means no peer here
        return {
            "status": "skipped",
            "note": f"torch FlexAttention not importable ({err.__class__.__name__})",
        }
    if not torch.cuda.is_available():
        return {"status": "skipped", "note": "torch has no CUDA device here"}
    b, h, n, d = case["b"], case["h"], case["n"], case["d"]
    _, rows, cols = uniform_graph(n, case["density"])
    dev = "cuda"
    dense = torch.zeros((n, n), dtype=torch.bool, device=dev)
    dense[torch.as_tensor(rows, device=dev).long(), torch.as_tensor(cols, device=dev).long()] = True

    def mask_mod(bb, hh, qi, kj):
        return dense[qi, kj]

    dt = torch.bfloat16 if case["dtype"] == "bf16" else torch.float32
    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, None, None, n, n, device=dev)
    flex = torch.compile(flex_attention)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, n, d, device=dev, dtype=dt)

    def step():
        out = flex(q, k, v, block_mask=bm)
        out.backward(g)

    step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < 2.0 and len(times) < 20):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"ms": 1e3 * times[len(times) // 2], "min_ms": 1e3 * times[0], "compile_s": compile_s,
            "reps": len(times), "torch": torch.__version__}  # fmt: skip


def run_lra_step(case, mechanism):
    try:
        import ml_collections  # noqa: F401 - the configs are ConfigDicts
    except ImportError:
        return {"status": "skipped", "note": "ml_collections not importable (carry it)"}
    import jax
    import numpy as np

    import configs.lra.pathfinder as pathfinder_config
    from sbm_jax.models.build import build_model
    from sbm_jax.training.host_data import split_micro_batches
    from sbm_jax.training.sharding import make_mesh
    from sbm_jax.training.state import ScheduleArgs, create_train_state, learning_rate_schedule
    from sbm_jax.training.steps import make_train_step
    from sbm_jax.training.task import Task

    n, batch = case["n"], case["b"]
    config = pathfinder_config.get_config(mechanism)
    config.model.max_len = n
    config.task.max_length = n
    config.train.batch_size = batch
    rng = np.random.default_rng(0)
    data = {
        "inputs": rng.integers(1, config.model.vocab_size, size=(batch, n)).astype(np.int32),
        "mask": np.ones((batch, n), bool),
        "targets": rng.integers(0, config.model.num_classes, size=(batch,)).astype(np.int32),
    }
    task = Task(name="path_x_mock", head="classification", train_batches=lambda s: iter([data]))
    model = build_model(config.model, "classification")
    state = create_train_state(config, model, task, data)
    schedule = learning_rate_schedule(*ScheduleArgs.of(config.train))
    step = make_train_step(
        task, make_mesh(1), float(config.train.density_lambda), schedule=schedule
    )
    data = split_micro_batches(data, 1)  # the step takes [micro-batches, rows, ...]
    t0 = time.perf_counter()
    state, _ = step(state, data)  # compiles; the step donates its state
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t = time.perf_counter()
        state, _ = step(state, data)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"ms": 1e3 * times[1], "min_ms": 1e3 * times[0], "compile_s": compile_s, "reps": 3,
            "layers": int(config.model.num_layers)}  # fmt: skip


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    kind = case["kind"]
    family, _, which = kind.partition("/")
    try:
        if family in ("cudnn", "xla"):
            res = run_flash(case, family)
        elif family == "sbm":
            res = run_sbm(case, which)
        elif family == "edge":
            res = run_edge(case, which)
        elif family == "flex":
            res = run_flex(case)
        elif family == "lra_step":
            res = run_lra_step(case, which)
        else:
            raise ValueError(f"unknown case kind {kind!r}")
    except ValueError as err:  # a route refused on this backend, before compilation
        if "needs" in str(err):
            return {"status": "skipped", "note": str(err).split(":")[0]}
        return {"status": "error", "error": f"ValueError: {err}"[:500]}
    except Exception as err:  # noqa: BLE001 - recorded, never dropped
        return {"status": "error", "error": f"{err.__class__.__name__}: {err}"[:500]}
    res.setdefault("status", "ok")
    return res


def worker(cases_path: str, results_path: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    with open(results_path, "a") as out:
        for i, case in enumerate(cases):
            out.write(json.dumps({"event": "start", "index": i}) + "\n")
            out.flush()
            res = run_case(case)
            out.write(json.dumps({"event": "done", "index": i, "result": res}) + "\n")
            out.flush()


# ----------------------------------------------------------------------- the parent side


def run_tests(args: argparse.Namespace, out_dir: Path, budget_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "tests/test_accelerator.py"]
    log = out_dir / "accelerator_tests.log"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s, env=_env()
        )
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        text, rc = f"{err.stdout or ''}{err.stderr or ''}\n[timed out after {budget_s:.0f} s]", None
    log.write_text(text if isinstance(text, str) else text.decode())
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return {"command": " ".join(cmd[1:]), "returncode": rc, "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_cases(cases, args, out_dir: Path, deadline: float) -> list[dict[str, Any]]:
    """Run ``cases`` in worker processes, each under its budget; one record per case."""
    results: list[dict[str, Any] | None] = [None] * len(cases)

    def budget_of(i: int) -> float:
        return case_budget(cases[i], args.tiny, args.case_budget_s)

    pending = list(range(len(cases)))
    while pending:
        if time.perf_counter() >= deadline:
            break
        batch = pending
        cases_path, results_path = out_dir / "worker_cases.json", out_dir / "worker_results.jsonl"
        cases_path.write_text(json.dumps([cases[i] for i in batch]))
        results_path.write_text("")
        err_path = out_dir / "worker_stderr.log"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(cases_path), str(results_path)],
                cwd=ROOT, env=_env(), stdout=err, stderr=err, start_new_session=True,
            )  # fmt: skip
        current, started = None, time.perf_counter()
        done_here: set[int] = set()
        while True:
            time.sleep(0.2)
            for line in results_path.read_text().splitlines():
                ev = json.loads(line)
                idx = batch[ev["index"]]
                if ev["event"] == "start" and current != idx and idx not in done_here:
                    current, started = idx, time.perf_counter()
                elif ev["event"] == "done" and idx not in done_here:
                    results[idx] = ev["result"]
                    done_here.add(idx)
                    _progress(cases[idx], ev["result"])
            finished = proc.poll() is not None
            now = time.perf_counter()
            over = (
                current is not None
                and current not in done_here
                and (now - started > case_budget(cases[current], args.tiny, args.case_budget_s))
            )
            if finished or over or now >= deadline:
                break
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if current is not None and current not in done_here:
            tail = err_path.read_text()[-400:]
            if over:
                rec = {
                    "status": "timeout",
                    "note": f"over its {budget_of(current):.0f} s budget",
                }
            elif time.perf_counter() >= deadline:
                rec = {"status": "timeout", "note": "stopped at the overall budget"}
            else:
                rec = {"status": "error", "error": f"worker died (rc {proc.returncode}): {tail}"}
            results[current] = rec
            done_here.add(current)
            _progress(cases[current], rec)
        pending = [i for i in pending if i not in done_here]
    for i in pending:
        results[i] = {"status": "skipped", "note": "no time left in the overall budget"}
    return [{**c, **r} for c, r in zip(cases, results, strict=True)]


def _progress(case, res) -> None:
    shape = f"B{case.get('b')} H{case.get('h', '-')} d{case.get('d', '-')}"
    what = res.get("ms") and f"{res['ms']:.2f} ms" or res.get("note") or res.get("error", "")
    print(f"[{res['status']:7s}] {case['kind']:14s} {shape} n={case['n']} "
          f"dens={case.get('density', '-')} {case['dtype']}: {what}", flush=True)  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    rows = report["cases"]
    ref = {}
    for r in rows:
        if r["kind"] == "cudnn" and r["status"] == "ok":
            ref[(r["b"], r["h"], r["d"], r["n"], r["density"])] = r["ms"]
    env = report["environment"]
    out = [
        "# Accelerator check",
        "",
        f"Device: {env['device']}; JAX {env['jax']}; torch {env.get('torch') or 'not importable'}.",
        f"Command: `{report['command']}`. Tests: {report['tests'].get('summary', 'not run')}.",
        "",
        "fwd+bwd times; `x flash` is the case's time over cuDNN flash attention (bf16) of",
        "the same shape, length and density. `kernel='auto'` on this backend: "
        f"`{env['auto_kernel']}` ({env['auto_note']}).",
        "",
        "| B | H | d_h | n | density | dtype | kind | ms | x flash | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        key = (r.get("b"), r.get("h"), r.get("d"), r["n"], r.get("density"))
        ms = r.get("ms")
        if "sampled_density" in r:
            r = {**r, "status": f"ok (sampled density {r['sampled_density']:.4f})"}
        ratio = f"{ms / ref[key]:.2f}" if ms and key in ref else ""
        note = (
            r["status"]
            if r["status"] == "ok"
            else f"{r['status']}: {r.get('note') or r.get('error', '')}"
        )
        note = note.replace("|", "/").replace("\n", " ")[:160]
        out.append(
            f"| {r.get('b', '')} | {r.get('h', '')} | {r.get('d', '')} | {r['n']} | "
            f"{r.get('density', '')} | {r['dtype']} | {r['kind']} | "
            f"{'' if ms is None else f'{ms:.2f}'} | {ratio} | {note} |"
        )
    out += ["", *target_lines(rows, ref)]
    return "\n".join(out) + "\n"


#: The issue's GPU targets: (label, B, H, d_h, n, density, most x flash).
TARGETS = (
    ("SBM 1%, n=32768, B=1 H=8 d_h=64", 1, 8, 64, 32768, 0.01, 1.0),
    ("SBM 1%, n=16384, B=1 H=8 d_h=64", 1, 8, 64, 16384, 0.01, 2.0),
    ("SBM 5%, n=4096, B=2 H=2 d_h=32", 2, 2, 32, 4096, 0.05, 4.0),
)


def target_lines(rows, ref) -> list[str]:
    """The target figures (bf16, fwd+bwd), from the table's own rows."""

    def key(r):
        return (r["kind"], r.get("b"), r.get("h"), r.get("d"), r["n"], r.get("density"), r["dtype"])

    ok = {key(r): r["ms"] for r in rows if r["status"] == "ok"}
    lines = ["| target (bf16, fwd+bwd) | kernel | x flash | goal | met |", "|---|---|---|---|---|"]
    for label, b, h, d, n, dens, goal in TARGETS:
        flash = ref.get((b, h, d, n, dens))
        for kernel in KERNELS:
            ms = ok.get((f"sbm/{kernel}", b, h, d, n, dens, "bf16"))
            if ms is None or flash is None:
                lines.append(f"| {label} | {kernel} | not measured | <= {goal} | |")
                continue
            ratio = ms / flash
            met = "yes" if ratio <= goal else "**no**"
            lines.append(f"| {label} | {kernel} | {ratio:.2f} | <= {goal} | {met} |")
    # rest of the layer (fastRG, edge list, STE products) over the edge kernel alone
    for kernel in KERNELS:
        sbm = ok.get((f"sbm/{kernel}", 2, 2, 32, 4096, 0.05, "bf16"))
        edge = ok.get((f"edge/{kernel}", 2, 2, 32, 4096, 0.05, "bf16"))
        val = f"{(sbm - edge) / edge:.2f}" if sbm and edge else "not measured"
        met = "" if not (sbm and edge) else ("yes" if (sbm - edge) / edge <= 0.5 else "**no**")
        label = "(SBM - edge kernel) / edge kernel, 5%, n=4096 (bounds fastRG / edge kernel)"
        lines.append(f"| {label} | {kernel} | {val} | <= 0.5 | {met} |")
    return lines


def environment() -> dict[str, Any]:
    import jax

    from sbm_jax.kernels.cost import EDGE_COST, resolve_kernel

    backend = jax.default_backend()
    try:
        import torch

        torch_version = torch.__version__
    except Exception:  # noqa: BLE001
        torch_version = None
    measured = "triton" in EDGE_COST.get(backend, {})
    note = (
        "the cheapest measured kernel"
        if measured
        else "the triton kernel's cost is unmeasured, so auto takes the cheapest measured one"
    )
    return {
        "device": str(jax.devices()[0].device_kind),
        "backend": backend,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "torch": torch_version,
        "auto_kernel": resolve_kernel("auto", backend),
        "auto_note": note,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="accelerator_check_out", help="output folder")
    p.add_argument("--budget-s", type=float, default=450.0, help="overall budget, seconds")
    p.add_argument("--tests-budget-s", type=float, default=120.0)
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal sizes")
    p.add_argument("--case-budget-s", type=float, default=None, help="one budget for every case")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "float32"], choices=["bf16", "float32"])
    p.add_argument("--kinds", nargs="+", default=None, help="only cases whose kind starts so")
    p.add_argument("--worker", nargs=2, metavar=("CASES", "RESULTS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lengths is None:
        args.lengths = [64] if args.tiny else [4096, 16384, 32768]
    if any(n < 8 for n in args.lengths):
        p.error(f"--lengths must be >= 8, got {args.lengths}")
    if any(not 0.0 < d <= 1.0 for d in args.densities):
        p.error(f"--densities must lie in (0, 1], got {args.densities}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tests = {"summary": "skipped (--skip-tests)"}
    if not args.skip_tests:
        tests = run_tests(args, out_dir, min(args.tests_budget_s, 0.4 * args.budget_s))
        print(f"[tests] {tests['summary']} ({tests['seconds']} s)", flush=True)
    cases = build_cases(args)
    if args.kinds:
        cases = [c for c in cases if c["kind"].startswith(tuple(args.kinds))]
    records = run_cases(cases, args, out_dir, deadline)
    report = {
        "command": " ".join(["python", "scripts/accelerator_check.py", *(argv or sys.argv[1:])]),
        "environment": environment(),
        "tests": tests,
        "seconds": round(time.perf_counter() - t0, 1),
        "cases": records,
    }
    (out_dir / "accelerator_table.json").write_text(json.dumps(report, indent=1))
    (out_dir / "accelerator_table.md").write_text(markdown(report))
    for name in ("worker_cases.json", "worker_results.jsonl"):
        (out_dir / name).unlink(missing_ok=True)
    print(f"wrote {out_dir / 'accelerator_table.md'} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
