"""``scripts/accelerator_check.py`` rehearsed on this CPU at tiny sizes, so that the
prepared device run cannot rot: every case is recorded (run, skipped with its reason,
or failed), the routes this backend cannot run are refused before compilation, and the
JSON and markdown tables are written."""

import json
import subprocess
import sys

from tests.scripts_testing import ROOT, load_script


def test_case_list_covers_the_grid_targets_first():
    script = load_script("accelerator_check")
    cases = script.build_cases(script.parse_args([]))
    grid = [c for c in cases if not c["kind"].startswith("lra_step")]
    assert len(grid) == 2 * 3 * 2 * 2 * len(script.KIND_ORDER)  # shapes, n, density, dtype
    assert {c["kind"] for c in grid} == set(script.KIND_ORDER)
    first = cases[0]
    # the target figures (bf16) first, shortest first, flash attention first
    targets = {(1, 8, 64, 32768, 0.01), (1, 8, 64, 16384, 0.01), (2, 2, 32, 4096, 0.05)}
    head = cases[: 3 * len(script.KIND_ORDER)]
    assert {(c["b"], c["h"], c["d"], c["n"], c["density"]) for c in head} == targets
    assert all(c["dtype"] == "bf16" for c in head)
    assert (first["n"], first["kind"]) == (4096, "cudnn")
    lra = [c for c in cases if c["kind"].startswith("lra_step")]
    assert [c["n"] for c in lra] == [16384, 16384]


def test_cpu_rehearsal_records_every_case(tmp_path):
    kinds = ["cudnn", "xla", "flex", "sbm/triton", "edge/triton", "edge/rows"]
    cmd = [sys.executable, "scripts/accelerator_check.py", "--tiny", "--skip-tests",
           "--out", str(tmp_path), "--densities", "0.05", "--budget-s", "120",
           "--kinds", *kinds]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "accelerator_table.json").read_text())
    by = {(c["kind"], c["dtype"]): c for c in report["cases"]}
    assert len(by) == len(kinds) * 2, "every case is recorded, none dropped"
    assert "CUDA GPU" in by["cudnn", "bf16"]["note"]
    assert "bf16/fp16 only" in by["cudnn", "float32"]["note"]
    for dtype in ("bf16", "float32"):
        for kind in ("sbm/triton", "edge/triton"):
            rec = by[kind, dtype]
            assert (
                rec["status"] == "skipped" and "kernel='triton' needs an NVIDIA GPU" in rec["note"]
            )
        for kind in ("xla", "edge/rows"):
            assert by[kind, dtype]["status"] == "ok" and by[kind, dtype]["ms"] > 0
        assert by["flex", dtype]["status"] in ("skipped", "ok")
    env = report["environment"]
    from sbm_jax.kernels.fused import fused_status

    assert env["backend"] == "cpu"
    assert env["auto_kernel"] == ("fused" if fused_status()[0] else "rows")  # the CPU kernel
    md = (tmp_path / "accelerator_table.md").read_text()
    assert md.count("\n| 1 | 2 | 8 | 64 |") == len(by)
    assert md.count("| not measured | <= ") == 3 * 3 + 3, "every target row, unmeasured here"
