"""User mistakes on the command line of the scripts: one line ``error: ...`` naming the
flag or the file, exit status 2, no traceback, found before any long work (nothing
measured, trained or printed first).

The absl scripts (synthetic_table, plot_metrics, plot_synthetic_ceiling, synthetic_drive)
define flags that clash with each other's (``--out``, ``--smooth``) and may exist only
once per process: each runs in a child process of its own, which calls its ``main``
through :func:`sbm_jax.script_usage.run` (what ``__main__`` does) once per case, plus
one plain ``python scripts/<name>.py`` run. The argparse scripts run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sbm_jax import script_usage
from tests.scripts_testing import ROOT, load_script

# In the child: load the script once, then one script_usage.run(main, argv) per case,
# flags reset to their defaults in between; the outcome of each as JSON on stdout.
DRIVER = r"""
import contextlib, io, json, sys, traceback
sys.path.insert(0, sys.argv[1])
from absl import flags
from sbm_jax import script_usage
from tests.scripts_testing import load_script

name, cases = sys.argv[2], json.loads(sys.argv[3])
module = load_script(name)
results = []
for argv in cases:
    if flags.FLAGS.is_parsed():
        flags.FLAGS.unparse_flags()
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            script_usage.run(module.main, [name + ".py", *argv])
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        except BaseException:
            traceback.print_exc()
            code = "exception"
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print("RESULTS " + json.dumps(results))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _python(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=_env(),
        check=False,
    )


def run_cases(name: str, cases: list[list[str]], cwd) -> list[dict]:
    """Each argv of ``cases`` through scripts/<name>.py's main, in one child process."""
    proc = _python(["-c", DRIVER, ROOT, name, json.dumps(cases)], cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :])


def run_script(name: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    """``python scripts/<name>.py ARGS`` as a user runs it."""
    return _python([os.path.join(ROOT, "scripts", f"{name}.py"), *args], cwd)


def assert_one_line_error(code, stdout: str, stderr: str, needle: str, what) -> None:
    assert "Traceback" not in stderr, (what, stderr)
    lines = stderr.strip().splitlines()
    assert code == 2, (what, code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), (what, stderr)
    assert needle in lines[0], (what, needle, lines[0])
    assert stdout == "", (what, stdout)  # nothing printed (nor measured) before it


def check_cases(name: str, cases: list[tuple[list[str], str]], cwd) -> None:
    results = run_cases(name, [argv for argv, _ in cases], cwd)
    for (argv, needle), result in zip(cases, results, strict=True):
        assert_one_line_error(
            result["code"], result["stdout"], result["stderr"], needle, (name, argv)
        )
    # And once as a user runs it: the first case through the script's __main__.
    argv, needle = cases[0]
    proc = run_script(name, argv, cwd)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, needle, (name, argv))


# --------------------------------------------------------------------- run folders
def _config(run, task="synthetic"):
    run.mkdir(parents=True, exist_ok=True)
    config = {"seed": 0, "task": {"name": task}, "model": {"attention": "sbm"}}
    (run / "config.json").write_text(json.dumps(config))
    return run


def _runs(tmp_path) -> dict[str, str]:
    """Run folders, each with one defect (and a good one), under ``tmp_path``."""
    runs = {}
    good = _config(tmp_path / "good")
    (good / "metrics.csv").write_text("step,loss,accuracy,density\n1,0.5,0.6,0.3\n")
    noconf = tmp_path / "noconf"
    noconf.mkdir()
    (noconf / "metrics.csv").write_text("step,loss,accuracy,density\n1,0.5,0.6,0.3\n")
    (_config(tmp_path / "header") / "metrics.csv").write_text("step,loss,accuracy,density\n")
    (_config(tmp_path / "empty") / "metrics.csv").write_text("")
    (_config(tmp_path / "csvdir") / "metrics.csv").mkdir()
    (_config(tmp_path / "nodens") / "metrics.csv").write_text("step,loss,accuracy\n1,0.5,0.6\n")
    (_config(tmp_path / "words") / "metrics.csv").write_text("step,accuracy\n1,high\n")
    badconf = _config(tmp_path / "badconf")
    (badconf / "config.json").write_text("{not json")
    (badconf / "metrics.csv").write_text("step,loss,accuracy,density\n1,0.5,0.6,0.3\n")
    # synthetic_drive --run_dir: checkpoints are listed (never restored) by the checks
    for step in (2, 4):
        (_config(tmp_path / "drive") / "checkpoints" / "latest" / str(step)).mkdir(parents=True)
    _config(tmp_path / "lra", task="lra_listops")
    _config(tmp_path / "nockpt")
    (tmp_path / "notes.txt").write_text("not a folder\n")
    for name in (
        "good",
        "noconf",
        "header",
        "empty",
        "csvdir",
        "nodens",
        "words",
        "badconf",
        "drive",
        "lra",
        "nockpt",
    ):
        runs[name] = str(tmp_path / name)
    return runs


# ---------------------------------------------------------------------- absl scripts
def test_synthetic_table_user_errors(tmp_path):
    r = _runs(tmp_path)
    check_cases(
        "synthetic_table",
        [
            ([r["noconf"]], "noconf/config.json does not exist"),
            ([r["header"]], "header/metrics.csv: no rows yet"),
            ([r["empty"]], "empty/metrics.csv: empty"),
            ([r["csvdir"]], "csvdir/metrics.csv: cannot read it"),
            ([r["words"]], "words/metrics.csv: not a metrics.csv"),
            ([r["badconf"]], "badconf/config.json: not JSON"),
            ([str(tmp_path / "notes.txt")], "notes.txt: not a run directory"),
            # a bad run after a good one: nothing printed for the good one first
            ([r["good"], r["header"]], "header/metrics.csv"),
            (["--smooth=0", r["good"]], "--smooth=0"),
            (["--smooth=-3", r["good"]], "--smooth=-3"),
            (["--leave=x", r["good"]], "--leave=x"),
            ([], "give one or more"),
        ],
        tmp_path,
    )


def test_plot_synthetic_ceiling_user_errors(tmp_path):
    r = _runs(tmp_path)
    out = str(tmp_path / "c.png")
    check_cases(
        "plot_synthetic_ceiling",
        [
            ([f"--out={out}", r["nodens"]], "nodens/metrics.csv: no density column"),
            ([f"--out={out}", r["header"]], "header/metrics.csv: no rows yet"),
            ([f"--out={out}", "--seq_len=0", r["good"]], "--seq_len=0"),
            ([f"--out={out}", "--seq_len=1", r["good"]], "--seq_len=1"),
            ([f"--out={out}", "--smooth=0", r["good"]], "--smooth=0"),
            ([f"--out={tmp_path}/no/c.png", r["good"]], "--out="),
            ([f"--out={tmp_path}", r["good"]], "is a directory"),
            ([f"--out={out}", str(tmp_path / "missing")], "missing does not exist"),
        ],
        tmp_path,
    )
    assert not os.path.exists(out)


def test_plot_metrics_user_errors(tmp_path):
    r = _runs(tmp_path)
    check_cases(
        "plot_metrics",
        [
            ([f"--out={tmp_path}/no/m.png", r["good"]], f"folder '{tmp_path}/no' does not exist"),
            ([f"--out={tmp_path}", r["good"]], "--out="),
            ([f"--out={tmp_path}/m.txt", r["good"]], "cannot write .txt"),
            (["--out=", r["good"]], "--out is empty"),
            ([f"--out={tmp_path}/m.png", r["csvdir"]], "csvdir/metrics.csv: cannot read it"),
            ([f"--out={tmp_path}/m.png", r["words"]], "words/metrics.csv: not a metrics.csv"),
            (["--bogus", r["good"]], "bogus"),
        ],
        tmp_path,
    )


def test_plot_metrics_prints_the_file_it_writes(tmp_path):
    # --out without an extension: matplotlib writes NAME.png, and that is what is printed.
    r = _runs(tmp_path)
    noext, png = str(tmp_path / "noext"), str(tmp_path / "m.png")
    results = run_cases(
        "plot_metrics", [[f"--out={noext}", r["good"]], [f"--out={png}", r["good"]]], tmp_path
    )
    assert [res["code"] for res in results] == [0, 0], results
    assert results[0]["stdout"].strip() == noext + ".png"
    assert os.path.isfile(noext + ".png") and not os.path.exists(noext)
    assert results[1]["stdout"].strip() == png and os.path.isfile(png)


def test_synthetic_drive_user_errors(tmp_path):
    r = _runs(tmp_path)
    check_cases(
        "synthetic_drive",
        [
            (["--preset=bogus"], "--preset='bogus'"),
            (["--inits=bogus"], "--inits: 'bogus'"),
            (["--inits="], "--inits is empty"),
            (["--seeds=x"], "--seeds='x'"),
            (["--seeds=-1"], "--seeds='-1'"),
            (["--steps=abc"], "--steps='abc' applies only with --run_dir"),
            (["--batches=0"], "--batches=0"),
            (["stray"], "unexpected arguments: stray"),
            ([f"--run_dir={tmp_path}/missing"], "--run_dir="),
            ([f"--run_dir={r['noconf']}"], "holds no config.json"),
            ([f"--run_dir={r['badconf']}"], "--run_dir"),
            ([f"--run_dir={r['lra']}"], "is a run of task 'lra_listops'"),
            ([f"--run_dir={r['nockpt']}"], "no checkpoints under"),
            ([f"--run_dir={r['drive']}", "--batches=0"], "--batches=0"),
            ([f"--run_dir={r['drive']}", "--steps=abc"], "--steps='abc' must be FIRST:LAST"),
            ([f"--run_dir={r['drive']}", "--steps=5:3"], "--steps='5:3': FIRST is after"),
            ([f"--run_dir={r['drive']}", "--steps=100:"], "no checkpoint of"),
            ([f"--run_dir={r['drive']}", "--seeds=1"], "--seeds: not used with --run_dir"),
            ([f"--run_dir={r['drive']}", "extra"], "unexpected arguments: extra"),
        ],
        tmp_path,
    )


# ------------------------------------------------------------------ argparse scripts
def _no_measuring(monkeypatch, *targets):
    def measured(*args, **kwargs):
        raise AssertionError("measured before the argument error")

    for module, name in targets:
        monkeypatch.setattr(module, name, measured)


def _expect_error(main, argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    assert_one_line_error(info.value.code, captured.out, captured.err, needle, argv)


@pytest.fixture
def saved_files(tmp_path):
    notjson = tmp_path / "notes.txt"
    notjson.write_text("not json\n")
    other = tmp_path / "other.json"
    other.write_text(json.dumps([1, 2]))
    unpaired = tmp_path / "unpaired.md"
    return {"notjson": str(notjson), "other": str(other), "unpaired": unpaired}


def test_benchmark_attention_user_errors(tmp_path, saved_files, monkeypatch, capsys):
    bench = load_script("benchmark_attention")
    _no_measuring(monkeypatch, (bench, "run"), (bench, "measure"), (bench, "layer_workload"))
    md = saved_files["unpaired"]
    md.write_text(f"# B\n\n{bench.BEGIN}\nold\n\n## Notes\n\nhand-written\n")
    json_out = ["--json", str(tmp_path / "b.json")]
    for argv, needle in [
        (["--impls", "bogus"], "--impls: 'bogus'"),
        (["--sizes", "0"], "--sizes must be > 0, got 0"),
        (["--sizes", "1024", "-8"], "--sizes must be > 0, got -8"),
        (["--heads", "0"], "--heads must be > 0"),
        (["--batch", "0"], "--batch must be > 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--max-gib", "-1"], "--max-gib must be > 0"),
        (["--layer-cases", "64:2"], "--layer-cases"),
        (["--layer-cases", "0:0.5"], "--layer-cases"),
        (["--layer-cases", "64:0.5:0"], "--layer-cases"),
        (["--peers", "performer", "bogus"], "--peers: bogus not among the mechanisms"),
        (["--peers", "sbm"], "--peers: sbm not among"),
        (["--peer-sizes", "0"], "--peer-sizes must be > 0"),
        (["--long-density", "2"], "--long-density"),
        (["--json", ""], "--json '': is empty"),
        (["--json", str(tmp_path)], "is a directory"),
        (["--json", "/proc/x.json"], "--json '/proc/x.json': cannot be created"),
        (["--json", str(tmp_path / "no" / "x.json")], "does not exist"),
        (["--from-json", saved_files["notjson"]], "not a JSON report"),
        (["--from-json", saved_files["other"]], "not a report of this script"),
        (["--markdown", str(md), *json_out], "unpaired or repeated"),
        (["--repeats", "3"], "--repeats must be >= 5"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ]:
        _expect_error(bench.main, argv if "--json" in argv else [*argv, *json_out], needle, capsys)
    assert not os.path.exists(tmp_path / "b.json")  # the probe of --json left nothing


def test_benchmark_sparse_patterns_user_errors(tmp_path, saved_files, monkeypatch, capsys):
    sp = load_script("benchmark_sparse_patterns")
    _no_measuring(monkeypatch, (sp, "run"), (sp, "chunk_sweep"), (sp, "measure_interleaved"))
    md = saved_files["unpaired"]
    md.write_text(f"# B\n\n{sp.SECTION}\n\n{sp.BEGIN}\nold\n\nReading it: by hand\n")
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"results": []}))
    json_out = ["--json", str(tmp_path / "s.json")]
    for argv, needle in [
        (["--repeats", "0"], "--repeats must be > 0, got 0"),
        (["--repeats", "-2"], "--repeats must be > 0, got -2"),
        (["--sizes", "0"], "--sizes must be > 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--json", "/proc/x.json"], "--json '/proc/x.json': cannot be created"),
        (["--from-json", saved_files["notjson"]], "not a JSON report"),
        (["--from-json", str(report)], "not a report of this script (no 'config')"),
        (["--chunk-sweep", "0", "--from-json", str(report)], "--chunk-sweep"),
        (["--markdown", str(md), *json_out], "unpaired or repeated"),
        (["--layers", "stridedd"], "invalid choice: 'stridedd'"),
    ]:
        _expect_error(sp.main, argv if "--json" in argv else [*argv, *json_out], needle, capsys)


def test_profile_layer_user_errors(tmp_path, monkeypatch, capsys):
    profile = load_script("profile_layer")
    _no_measuring(monkeypatch, (profile, "profile"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, needle in [
        (["--json", str(tmp_path / "nodir" / "x.json")], "--json"),
        (["--json", "/proc/x.json"], "cannot be created"),
        (["--trace-dir", str(afile)], "--trace-dir"),
        (["--n", "0"], "--n must be > 0, got 0"),
        (["--n", "-5"], "--n must be > 0, got -5"),
        (["--heads", "0"], "--heads must be > 0"),
        (["--top", "-3"], "--top must be >= 0"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ]:
        _expect_error(profile.main, argv, needle, capsys)


# ------------------------------------------------------------ generated markdown blocks
@pytest.mark.parametrize(
    "layout",
    ["begin only", "end only", "two begins", "two blocks", "end before begin"],
)
def test_unpaired_markers_are_refused_and_the_file_kept(tmp_path, layout):
    # A BEGIN without its END used to make write_markdown append a new block; the next
    # run then replaced everything from the old BEGIN to the new END: the notes between.
    bench = load_script("benchmark_attention")
    sp = load_script("benchmark_sparse_patterns")
    stack = load_script("stack_memory")
    floors = load_script("cost_floors")
    for module in (bench, sp, stack, floors):  # each script's own markers, one shared writer
        b, e = module.BEGIN, module.END
        text = {
            "begin only": f"# B\n\n{b}\nold\n\n## Notes\n\nhand-written\n",
            "end only": f"# B\n\nold\n{e}\n\nhand-written\n",
            "two begins": f"# B\n\n{b}\nold\n{b}\nold\n{e}\nhand-written\n",
            "two blocks": f"{b}\nold\n{e}\nhand-written\n{b}\nnew\n{e}\n",
            "end before begin": f"# B\n{e}\nhand-written\n{b}\n",
        }[layout]
        with pytest.raises(ValueError, match="unpaired or repeated"):
            bench.replace_block(text, b, e, f"{b}\nnew\n{e}\n")
        doc = tmp_path / "doc.md"
        doc.write_text(text)
        with pytest.raises(ValueError, match="doc.md"):
            module.write_markdown(doc, "new\n")
        assert doc.read_text() == text
    # Paired markers are still replaced; no markers: None (the block is appended).
    b, e = bench.BEGIN, bench.END
    assert bench.replace_block(f"a\n{b}\nx\n{e}\nz\n", b, e, "B\n") == "a\nB\n\nz\n"
    assert bench.replace_block("a\n", b, e, "B\n") is None


def test_a_second_run_on_an_unpaired_begin_keeps_the_notes(tmp_path, monkeypatch, capsys):
    # The audit's case end to end, with --from-json (nothing measured): refused before
    # anything is written, twice, and the hand-written notes stay.
    bench = load_script("benchmark_attention")
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"command": "x", "results": [], "config": {}}))
    doc = tmp_path / "benchmarks.md"
    text = f"# Attention benchmarks\n\n{bench.BEGIN}\nold\n\n## Notes\n\nhand-written\n"
    doc.write_text(text)
    monkeypatch.setattr(bench, "print_table", lambda report: None)
    for _ in range(2):
        _expect_error(
            bench.main,
            ["--from-json", str(report), "--markdown", str(doc)],
            "benchmarks.md",
            capsys,
        )
        assert doc.read_text() == text


def test_script_usage_helpers(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        script_usage.fail("two\nlines")
    assert info.value.code == 2 and capsys.readouterr().err == "error: two lines\n"
    assert script_usage.output_file("out", str(tmp_path / "x"), ".png") == str(tmp_path / "x.png")
    assert script_usage.image_file("out", str(tmp_path / "x.pdf")) == str(tmp_path / "x.pdf")
    with pytest.raises(script_usage.UsageError, match="is a directory"):
        script_usage.output_file("out", str(tmp_path))
