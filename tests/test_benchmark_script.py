"""scripts/benchmark_attention.py: its markdown block is rewritten in place, and only it."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.scripts_testing import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_attention")


def test_markdown_block_is_replaced_and_other_sections_kept(bench, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Attention benchmarks\n\nintro\n\n"
        f"{bench.BEGIN}\nold table\n{bench.END}\n\n## Notes\n\nhand-written\n\n"
        "## Sparse Transformer patterns\n\n<!-- BEGIN GENERATED: other.py -->\nx\n"
        "<!-- END GENERATED: other.py -->\n"
    )
    bench.write_markdown(doc, "new table\n")
    text = doc.read_text()
    assert "old table" not in text and text.count("new table") == 1
    for kept in ("intro", "## Notes", "hand-written", "## Sparse Transformer patterns", "\nx\n"):
        assert kept in text
    assert text.index("intro") < text.index("new table") < text.index("## Notes")
    bench.write_markdown(doc, "newer\n")  # idempotent: one block, rewritten again
    assert doc.read_text().count(bench.BEGIN) == 1 and "newer" in doc.read_text()


def test_old_markers_are_migrated_and_missing_block_appended(bench, tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("top\n<!-- BEGIN GENERATED -->\nold\n<!-- END GENERATED -->\nbottom\n")
    bench.write_markdown(doc, "fresh\n")
    text = doc.read_text()
    assert "old" not in text and "fresh" in text and "top" in text and "bottom" in text
    other = tmp_path / "c.md"
    other.write_text("# Only prose\n")
    bench.write_markdown(other, "table\n")
    assert other.read_text().startswith("# Only prose") and "table" in other.read_text()


def test_layer_target_table_from_a_saved_report(bench):
    # Ratios and verdicts from measured records (no timing here): against the exact
    # (chunked) full layer of the same case, never the naive one beside it.
    rec = dict(section="layer", n=4096, density=0.05, batch=2, heads=2)
    exact = {**rec, "kind": "full", "implementation": "chunked", "median_s": 2.0}
    report = {
        "config": {"impls": ["rows"], "batch": 2, "heads": 2, "head_dim": 32},
        "results": [
            {**exact, "temp_bytes": 1000},
            {**rec, "kind": "full_xla", "median_s": 6.0, "temp_bytes": 9000,
             "median_round_ratio": 3.0},
            {**rec, "kind": "sbm", "median_s": 1.0, "temp_bytes": 200, "median_round_ratio": 0.45},
        ],
    }  # fmt: skip
    rows = {r["figure"]: r for r in bench.layer_target_rows(report)}
    mem = rows["SBM 5%, n=4096: temp memory / exact full"]
    assert mem["value"] == pytest.approx(0.2) and mem["met"] is True
    tim = rows["SBM 5%, n=4096: time / exact full"]
    assert tim["value"] == pytest.approx(0.45) and tim["met"] is True
    assert rows["SBM 1%, n=4096: time / exact full"]["value"] is None
    full_row, naive_row, sbm_row = bench.ratio_rows(report)
    assert full_row["what"] == "full (chunked, exact baseline)"
    assert naive_row["what"] == "full (xla, naive)" and naive_row["time_vs_exact"] == 3.0
    assert sbm_row["time_vs_naive"] == pytest.approx(0.15)  # 0.45 / 3.0, per-round ratios
    assert sbm_row["temp_vs_naive"] == pytest.approx(200 / 9000)
    # 1% at n=4096 against Performer, and bytes per sampled edge at n=16384, B=1.
    one = dict(section="layer", n=4096, density=0.01, batch=2, heads=2)
    report["results"] += [
        {**one, "kind": "full", "implementation": "chunked", "median_s": 2.0, "temp_bytes": 1000},
        {**one, "kind": "sbm", "median_s": 0.3, "median_round_ratio": 0.15, "temp_bytes": 250},
        {**one, "kind": "performer", "median_s": 0.4, "median_round_ratio": 0.2,
         "temp_bytes": 200},
    ]  # fmt: skip
    long = dict(section="layer", n=16384, density=0.01, batch=1, heads=2)
    report["results"] += [
        {**long, "kind": "full", "implementation": "chunked", "median_s": 4.0, "temp_bytes": 10},
        {**long, "kind": "sbm", "median_s": 0.2, "sampled_density": 0.01, "temp_bytes": 2**27},
    ]
    rows = {r["figure"]: r for r in bench.layer_target_rows(report)}
    assert rows["SBM 1%, n=4096: time / Performer's"]["value"] == pytest.approx(0.75)
    perf_mem = rows["SBM 1%, n=4096: temp memory / Performer's"]
    assert perf_mem["value"] == pytest.approx(1.25) and perf_mem["met"] is False
    per_edge = rows["SBM 1%, n=16384, B=1: compiled temp bytes per sampled edge"]
    assert per_edge["value"] == pytest.approx(2**27 / (0.01 * 16384**2 * 2))
    # A report from before the exact baseline (its full layer naive) gives no layer
    # ratios against "exact full": they would be the naive ones under another name.
    old = {
        "config": report["config"],
        "results": [dict(report["results"][0]), report["results"][2]],
    }
    del old["results"][0]["implementation"]
    assert bench.layer_target_rows(old)[0]["value"] is None
    assert bench.ratio_rows(old)[0]["what"] == "full (xla, naive)"
    fastrg = "fastRG (bernoulli) time / attention core fwd+bwd, 5%"
    rows = {r["figure"]: r for r in bench.kernel_target_rows(report)}
    assert rows[fastrg]["value"] is None  # neither measured
    core = dict(section="core", n=4096, density=0.05, impl="rows", median_s=0.5)
    sample = dict(section="sample", n=4096, density=0.05, kind="fastRG bernoulli", median_s=0.6)
    report["results"] += [core, sample]
    rows = {r["figure"]: r for r in bench.kernel_target_rows(report)}
    assert rows[fastrg]["value"] == pytest.approx(1.2) and rows[fastrg]["met"] is False
    # Timed in alternation with the core: the median of the per-round ratios counts.
    sample.update(median_round_ratio=0.95, core_median_s=0.6)
    rows = {r["figure"]: r for r in bench.kernel_target_rows(report)}
    assert rows[fastrg]["value"] == pytest.approx(0.95) and rows[fastrg]["met"] is True
    # Core ratios divide by the exact core, the naive one beside it.
    report["results"] += [
        dict(section="dense", n=4096, impl="exact: chunked", median_s=1.0, temp_bytes=100),
        dict(section="dense", n=4096, impl="jax.nn.dot_product_attention", median_s=2.0),
    ]
    rows = {r["figure"]: r for r in bench.kernel_target_rows(report)}
    five = rows["core fwd+bwd time / exact, density 5%"]
    assert five["value"] == pytest.approx(0.5) and five["vs_naive"] == pytest.approx(0.25)
    (row,) = [r for r in bench.ratio_rows(report) if r["what"] == "fastRG bernoulli"]
    assert "alternation" in row["note"] and "600.0 ms" in row["note"], row


def test_a_stopped_run_keeps_what_it_measured(bench, tmp_path, monkeypatch, capsys):
    # The JSON is rewritten after every record, so a run killed by a timeout (a lent
    # accelerator's time limit, a cluster's) leaves its records; --from-json renders them.
    calls = []

    def fake_measure(fn, args, **kw):
        calls.append(fn)
        if len(calls) > 1:
            raise KeyboardInterrupt  # the run is stopped during its second measurement
        return {"median_s": 0.25, "times_s": [0.25] * 5, "temp_bytes": 2**20}

    monkeypatch.setattr(bench, "measure", fake_measure)
    out = tmp_path / "run.json"
    argv = ["--sizes", "64", "--densities", "0.05", "--impls", "rows", "--no-targets"]
    argv += ["--no-layer", "--no-sampler", "--long", "--lra-step", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    saved = json.loads(out.read_text())
    assert saved["partial"] is True and len(saved["results"]) == 1
    rec = saved["results"][0]
    assert rec["section"] == "dense" and rec["median_s"] == 0.25 and rec["n"] == 64
    assert saved["command"].endswith(str(out)) and saved["machine"]["backend"] == "cpu"
    # The host is named (ratios move with it) and the commit measured.
    mach = saved["machine"]
    assert mach["cpu"] and mach["cpu"] != "unknown CPU" and mach["commit"]
    md = tmp_path / "b.md"
    bench.main(["--from-json", str(out), "--markdown", str(md)])
    text = md.read_text()
    assert "**Partial run** (stopped after 1 records)." in text
    assert f"CPUs ({mach['cpu']})" in text and f"commit {mach['commit']}." in text


def test_layer_options_reach_the_sbm_layer_only_and_the_report(bench, tmp_path, monkeypatch):
    args = bench.parse_args(["--layer-options", "ste=pairs", "pair_probes=8", "delta=0.05"])
    assert args.layer_options == {"ste": "pairs", "pair_probes": 8, "delta": 0.05}
    with pytest.raises(SystemExit):
        bench.parse_args(["--layer-options", "ste"])  # not FIELD=VALUE
    seen = []

    def fake_workload(kind, b, h, d, n, density, options=None, shift=None, dtype=None):
        seen.append((kind, options))
        return (lambda *a: None), (), {}

    def fake_interleaved(loads, **kw):
        return [{"median_s": 1.0, "times_s": [1.0] * 5, "temp_bytes": 2**20} for _ in loads]

    monkeypatch.setattr(bench, "layer_workload", fake_workload)
    monkeypatch.setattr(bench, "measure_interleaved", fake_interleaved)
    out = tmp_path / "run.json"
    argv = ["--no-core", "--no-sampler", "--no-targets", "--long", "--lra-step"]
    argv += ["--layer-cases", "64:0.05", "--layer-options", "ste=pairs", "--json", str(out)]
    bench.main([*argv, "--peers", "performer", "--peer-sizes", "32"])  # no peers at n=64
    assert seen == [("full", None), ("full_xla", None), ("sbm", {"ste": "pairs"})]
    seen.clear()
    bench.main([*argv, "--peers", "performer", "local", "--peer-sizes", "64"])
    kinds = ["full", "full_xla", "sbm", "performer", "local"]
    assert seen == [(k, {"ste": "pairs"} if k == "sbm" else None) for k in kinds]
    saved = json.loads(out.read_text())
    assert saved["config"]["layer_options"] == {"ste": "pairs"}
    md = tmp_path / "b.md"
    bench.main(["--from-json", str(out), "--markdown", str(md)])
    assert "`SBMAttention` with the module's defaults but `ste='pairs'`" in md.read_text()


def test_an_sbm_variant_row_runs_beside_sbm_with_its_fields_and_sbm_s_shift(
    bench, tmp_path, monkeypatch
):
    seen = []

    def fake_workload(kind, b, h, d, n, density, options=None, shift=None, dtype=None):
        seen.append((kind, options, shift))
        info = {"sbm": {"shift": 1.5}, "full": {"implementation": "chunked"}}.get(kind, {})
        return (lambda *a: None), (), dict(info)

    def fake_interleaved(loads, **kw):
        return [
            {
                "median_s": 1.0 + i,
                "times_s": [1.0] * 5,
                "temp_bytes": 2**20,
                "sampled_density": 0.05,
            }
            for i, _ in enumerate(loads)
        ]

    monkeypatch.setattr(bench, "layer_workload", fake_workload)
    monkeypatch.setattr(bench, "measure_interleaved", fake_interleaved)
    out = tmp_path / "run.json"
    argv = ["--no-core", "--no-sampler", "--no-targets", "--long", "--lra-step", "--no-naive"]
    argv += ["--layer-cases", "64:0.05", "--layer-options", "ste=pairs"]
    argv += ["--sbm-variant", "edge_cache=16", "--json", str(out)]
    bench.main(argv)
    assert seen == [
        ("full", None, None),
        ("sbm", {"ste": "pairs"}, None),
        ("sbm", {"ste": "pairs", "edge_cache": 16}, 1.5),
    ]
    rows = bench.ratio_rows(json.loads(out.read_text()))
    assert [r["what"] for r in rows] == [
        "full (chunked, exact baseline)",
        "sbm",
        "sbm (edge_cache=16)",
    ]
    assert rows[2]["density"] == 0.05 and rows[2]["time_vs_exact"] == 3.0
    args = bench.parse_args([*argv[:-2], "--layer-processes", "2"])
    cmd = bench.layer_child_command(args, 64, 0.05, "x.json")
    assert cmd[cmd.index("--sbm-variant") + 1] == "edge_cache=16"
    with pytest.raises(SystemExit):
        bench.parse_args(["--sbm-variant", "edge_cache=-1"])  # the layer's own check


def test_layer_rows_report_page_faults_and_cpu_time(bench):
    # A real call: the counters come from getrusage around it (Linux here).
    exe = jax.jit(lambda x: jnp.sort(x) * 2.0).lower(jnp.zeros(4096)).compile()
    call = bench.timed_call(exe, (jnp.arange(4096.0),))
    assert call["s"] > 0 and call["faults"] >= 0 and call["sys_s"] >= 0

    # User CPU is the process's: a call that computes for a while is charged some.
    def busy(x):
        return jax.lax.fori_loop(0, 200, lambda i, y: jnp.tanh(y @ x), x)

    x = jnp.eye(256) * 0.5
    exe = jax.jit(busy).lower(x).compile()
    call = bench.timed_call(exe, (x,))
    assert call["user_s"] > 0 and call["user_s"] + call["sys_s"] <= 64 * call["s"]
    summary = bench.call_summary(
        [{"s": 0.3, "faults": 10, "sys_s": 0.02}, {"s": 0.1, "faults": 30, "sys_s": 0.01},
         {"s": 0.2, "faults": 20, "sys_s": 0.03}]
    )  # fmt: skip
    assert summary["median_s"] == pytest.approx(0.2) and summary["faults_per_call"] == 20
    assert summary["sys_s_per_call"] == pytest.approx(0.02)
    assert "faults_per_call" not in bench.call_summary([{"s": 0.1}])  # no counters: none
    assert "user_s_per_call" not in summary  # recorded only where every call has it
    with_user = bench.call_summary(
        [{"s": 0.3, "faults": 1, "sys_s": 0.0, "user_s": 0.5},
         {"s": 0.1, "faults": 1, "sys_s": 0.0, "user_s": 0.1},
         {"s": 0.2, "faults": 1, "sys_s": 0.0, "user_s": 0.35}]
    )  # fmt: skip
    assert with_user["user_s_per_call"] == pytest.approx(0.35)
    rec = dict(section="layer", n=1024, density=0.05)
    report = {
        "results": [
            {**rec, "kind": "full", "median_s": 0.07, "faults_per_call": 16905.0,
             "sys_s_per_call": 0.040},
            {**rec, "kind": "sbm", "median_s": 0.1, "path": 1, "sampled_density": 0.05,
             "faults_per_call": 11622.0, "sys_s_per_call": 0.024, "median_round_ratio": 1.46},
        ]
    }  # fmt: skip
    full, sbm = bench.ratio_rows(report)
    assert full["note"] == "16905 page faults and 40 ms system CPU per call"
    assert sbm["note"].startswith("path 1 (bucket), sampled density 0.050; median of per-round")
    assert sbm["note"].endswith("; 11622 page faults and 24 ms system CPU per call")
    # With user CPU recorded (how many cores the call kept busy), the note has it too.
    report["results"][0]["user_s_per_call"] = 0.081
    full, _ = bench.ratio_rows(report)
    assert full["note"] == "16905 page faults, 40 ms system and 81 ms user CPU per call"


def test_interleaved_rounds_shuffle_and_ratios_pair_one_round(bench, monkeypatch):
    # Three real compiled workloads; the timer is replaced so that each call's "time"
    # names its workload and its round: the ratios must pair calls of the same round.
    loads = [(lambda x, c=c: x * c, (jnp.ones(4),)) for c in (1.0, 2.0, 3.0)]
    order = []

    def fake_timed_call(compiled, args):
        which = int(round(float(compiled(*args)[0]))) - 1
        order.append(which)
        rnd = (len(order) - 1) // 3 + 1  # 1, 1, 1, 2, 2, 2, ...
        return {"s": (which + 1) * 10.0**rnd}

    monkeypatch.setattr(bench, "timed_call", fake_timed_call)
    kw = dict(repeats=6, warmup=0, max_bytes=float("inf"))
    infos = bench.measure_interleaved(loads, **kw)
    assert order == [0, 1, 2] * 6
    assert infos[2]["round_ratios"] == [3.0] * 6
    order.clear()
    infos = bench.measure_interleaved(loads, shuffle_seed=0, **kw)
    rounds = [order[3 * r : 3 * r + 3] for r in range(6)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds
    assert infos[1]["round_ratios"] == [2.0] * 6 and infos[2]["round_ratios"] == [3.0] * 6
    assert infos[0]["times_s"] == [10.0**r for r in range(1, 7)]


def test_sparse_patterns_script_runs_and_reports_the_host(tmp_path):
    sp = load_script("benchmark_sparse_patterns")
    out, md = tmp_path / "sp.json", tmp_path / "b.md"
    argv = ["--sizes", "64", "--layers", "full", "strided", "--repeats", "2"]
    sp.main([*argv, "--json", str(out), "--markdown", str(md)])
    report = json.loads(out.read_text())
    mach = report["machine"]
    assert mach["cpu"] and mach["commit"]
    assert [r["layer"] for r in report["results"]] == ["full", "strided"]
    assert all(len(r["times_s"]) == 2 for r in report["results"])
    text = md.read_text()
    assert f"CPUs ({mach['cpu']})" in text and f"commit {mach['commit']}." in text
    assert "| 64 | strided | 8 |" in text


def test_sparse_patterns_block_is_rewritten_and_the_prose_after_it_kept(tmp_path):
    sp = load_script("benchmark_sparse_patterns")
    doc = tmp_path / "b.md"
    doc.write_text(f"# B\n\n{sp.SECTION}\n\n{sp.BEGIN}\nold\n{sp.END}\n\nReading it:\n")
    for body in ("new\n", "newer\n"):  # twice: the blank line before the prose stays
        sp.write_markdown(doc, body)
        assert doc.read_text() == (
            f"# B\n\n{sp.SECTION}\n\n{sp.BEGIN}\n{body}{sp.END}\n\nReading it:\n"
        )


def test_bad_arguments_stop_before_measuring(bench, tmp_path, capsys):
    # A misspelt layer option used to skip every SBM row and run on (with the long
    # runs); a bad path failed with a traceback, after the run for --markdown.
    sp = load_script("benchmark_sparse_patterns")
    profile = load_script("profile_layer")
    cases = [
        (bench.parse_args, ["--layer-options", "stee=pairs"], "--layer-options.stee is not"),
        (bench.parse_args, ["--layer-options", "ste=pair"], "ste='pair' is not an estimator"),
        (profile.parse_args, ["--layer-options", "stee=pairs"], "--layer-options.stee is not"),
        (bench.parse_args, ["--from-json", str(tmp_path / "nope.json")], "no such file"),
        (sp.parse_args, ["--from-json", str(tmp_path / "nope.json")], "no such file"),
        (sp.parse_args, ["--markdown", str(tmp_path / "no" / "x.md")], "does not exist"),
        (sp.parse_args, ["--layers", "stridedd"], "invalid choice: 'stridedd'"),
    ]
    for parse, argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    assert bench.parse_args(["--layer-options", "ste=pairs", "pair_probes=8"]).layer_options == {
        "ste": "pairs",
        "pair_probes": 8,
    }
    assert sp.parse_args(["--layers", "strided", "fixed c=8"]).layers == ["strided", "fixed c=8"]


def test_layer_cases_in_fresh_processes_report_medians_and_range(bench, tmp_path, monkeypatch):
    # The children are replaced by a fake that checks their command line (this script,
    # the one case alone, this run's settings) and writes a report with known times.
    ratios = iter([0.9, 0.7, 1.1, 0.8])
    seen = []
    real_run = subprocess.run

    def fake_run(cmd, **kw):
        if cmd[0] != sys.executable:  # `git rev-parse` for the report's header
            return real_run(cmd, **kw)
        assert cmd[:2] == [sys.executable, str(Path(bench.__file__).resolve())]
        child = bench.parse_args(cmd[2:])
        assert child.layer_cases == [(1024, 0.05, None)] and child.no_core and child.no_sampler
        assert child.peers == ["performer"] and child.peer_sizes == [4096]
        assert child.long == [] and child.lra_step == [] and child.no_targets
        assert (child.batch, child.heads, child.repeats, child.warmup) == (1, 3, 7, 2)
        assert child.layer_options == {"ste": "pairs"} and child.heads_mode == "vmap"
        seen.append(cmd)
        if len(seen) == 3:  # this one fails: reported, never hidden, not merged
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback\nMemoryError: boom\n")
        r = next(ratios)
        rec = dict(section="layer", n=1024, density=0.05, temp_bytes=100)
        recs = [
            {**rec, "kind": "full", "median_s": 0.1 * len(seen), "times_s": [0.1] * 7,
             "implementation": "chunked"},
            {**rec, "kind": "sbm", "median_s": 0.1 * len(seen) * r, "median_round_ratio": r,
             "path": 1, "sampled_density": 0.05, "temp_bytes": 40, "round_ratios": [r] * 7},
        ]  # fmt: skip
        Path(child.json).write_text(json.dumps({"results": recs}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "run.json"
    argv = ["--no-core", "--no-sampler", "--no-targets", "--long", "--lra-step"]
    argv += ["--layer-cases", "1024:0.05", "--layer-processes", "5", "--batch", "1"]
    argv += ["--heads", "3", "--repeats", "7", "--warmup", "2", "--head-map", "vmap"]
    argv += ["--peers", "performer"]
    bench.main([*argv, "--layer-options", "ste=pairs", "--json", str(out)])
    assert len(seen) == 5
    report = json.loads(out.read_text())
    # (The failed process's skipped full_xla record is kept too: these children timed no
    # naive layer.)
    full, sbm, naive = (r for r in report["results"] if r["section"] == "layer")
    assert naive["kind"] == "full_xla" and "skipped" in naive
    # Four processes timed the layers (0.9, 0.7, 0.8, and 1.1 for the fourth and fifth
    # calls' order): medians over them, the per-process values kept.
    assert sbm["process_median_round_ratio"] == [0.9, 0.7, 1.1, 0.8]
    assert sbm["median_round_ratio"] == pytest.approx(0.85) and sbm["processes"] == 4
    assert full["median_s"] == pytest.approx(np.median([0.1, 0.2, 0.4, 0.5]))
    assert "times_s" not in full and "round_ratios" not in sbm
    _, sbm_row, _ = bench.ratio_rows(report)
    assert sbm_row["time_vs_exact"] == pytest.approx(0.85)
    assert sbm_row["temp_vs_exact"] == pytest.approx(0.4)
    assert "0.850 (the median over 4 processes, which read 0.700-1.100)" in sbm_row["note"]
    md = tmp_path / "b.md"
    bench.main(["--from-json", str(out), "--markdown", str(md)])
    assert "Each layer case ran in 5 fresh processes of its own" in md.read_text()
    # Every process failing keeps the reason in the report.
    monkeypatch.setattr(
        bench.subprocess,
        "run",
        lambda cmd, **kw: (
            subprocess.CompletedProcess(cmd, 137, "", "Killed\n")
            if cmd[0] == sys.executable
            else real_run(cmd, **kw)
        ),
    )
    bench.main([*argv, "--json", str(out)])
    recs = json.loads(out.read_text())["results"]
    assert [r["skipped"] for r in recs] == ["process 1/5 exited with 137: Killed"] * 3
    assert [r["kind"] for r in recs] == ["full", "full_xla", "sbm"]


@pytest.mark.slow
def test_layer_processes_run_this_script_for_real(bench, tmp_path):
    # Two real child processes at a small n: both layers timed in each, merged.
    out = tmp_path / "run.json"
    argv = ["--no-core", "--no-sampler", "--no-targets", "--long", "--lra-step"]
    argv += ["--layer-cases", "64:0.5", "--layer-processes", "2", "--batch", "1"]
    bench.main([*argv, "--repeats", "5", "--json", str(out)])
    full, naive, sbm = json.loads(out.read_text())["results"]
    assert (full["kind"], naive["kind"], sbm["kind"]) == ("full", "full_xla", "sbm")
    assert full["implementation"] == "chunked" and sbm["processes"] == 2
    assert len(sbm["process_median_round_ratio"]) == 2 and full["temp_bytes"] > 0
    assert min(full["process_median_s"]) <= full["median_s"] <= max(full["process_median_s"])
    assert abs(sbm["sampled_density"] - 0.5) < 0.1


def test_nnx_face_against_linen_at_a_tiny_size(bench, tmp_path, capsys):
    # A rehearsal of `--nnx` (the target is n=4096, 5%): both layers measured in
    # one process on the same parameters and sample key, so they sample the same graph.
    out = tmp_path / "nnx.json"
    argv = ["--nnx", "--layer-cases", "32:0.25", "--batch", "1", "--head-dim", "4"]
    bench.main([*argv, "--json", str(out)])
    (rec,) = json.loads(out.read_text())["results"]
    assert rec["section"] == "nnx" and (rec["n"], rec["density"], rec["batch"]) == (32, 0.25, 1)
    assert rec["linen_loss"] == rec["nnx_loss"]  # the same graph, the same math
    for side in ("linen", "nnx", "linen_stats"):
        assert len(rec[side]["times_s"]) == 5 and rec[side]["temp_bytes"] > 0
        assert rec["cost"][side]["flops"] > 0 and rec["cost"][side]["bytes accessed"] > 0
    assert len(rec["nnx"]["round_ratios"]) == 5
    assert rec["nnx_over_linen"] == pytest.approx(np.median(rec["nnx"]["round_ratios"]), abs=1e-4)
    paired = np.median(np.array(rec["nnx"]["times_s"]) / rec["linen_stats"]["times_s"])
    assert rec["nnx_over_linen_stats"] == pytest.approx(paired, rel=1e-3)
    assert rec["met"] is (rec["nnx_over_linen"] <= bench.NNX_TARGET)
    assert 0.0 < rec["nnx_density"] <= 1.0
    # The face computes what the Linen step that collects the stats computes.
    assert rec["cost"]["nnx"]["flops"] == pytest.approx(
        rec["cost"]["linen_stats"]["flops"], rel=1e-3
    )
    text = capsys.readouterr().out
    assert "n=32 25% B=1: linen " in text and "nnx/linen " in text and "same loss True" in text
    assert "linen with stats " in text and "bytes accessed" in text
