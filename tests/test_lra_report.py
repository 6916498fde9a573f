"""scripts/lra_report.py on roots that cannot make one honest report: unfinished and
unreadable runs are named, duplicate seeds and mixed configs refused, user errors one
line (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.scripts_testing import forget_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _forget_lra_report_flags():
    """lra_report's absl flags (--root, --out) must not outlive this module: the sweep's
    tests import lra_sweep, which defines --root too."""
    yield
    forget_script("scripts.lra_report")


def _run(root, name: str, seed: int, steps: int = 6, lam: float = 0.0) -> str:
    from configs.lra import listops
    from sbm_jax.training.run_dir import config_as_json

    config = config_as_json(listops.get_config(f"sbm,smoke,seed={seed}"))
    config["train"]["num_steps"] = steps
    summary = {
        "task": "lra_listops",
        "attention": "sbm",
        "seed": seed,
        "density_lambda": lam,
        "test_accuracy": 0.5,
        "test_density": 0.2,
        "config": config,
    }
    directory = os.path.join(root, name)
    os.makedirs(directory)
    with open(os.path.join(directory, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return directory


def test_unfinished_and_unreadable_runs_are_named(tmp_path):
    from scripts import lra_report

    _run(tmp_path, "a", 0)
    unfinished = _run(tmp_path, "b", 1)
    os.remove(os.path.join(unfinished, "summary.json"))
    torn = _run(tmp_path, "c", 2)
    with open(os.path.join(torn, "summary.json"), "w", encoding="utf-8") as f:
        f.write('{"task": "lra_li')  # a write cut short
    notes: list[str] = []
    summaries = lra_report.load_summaries(str(tmp_path), notes)
    assert [s["seed"] for s in summaries] == [0]
    assert summaries[0]["run_dir"] == str(tmp_path / "a")
    assert any(unfinished in n and "unfinished" in n for n in notes), notes
    assert any(torn in n and "unreadable" in n for n in notes), notes


def test_duplicate_seeds_and_mixed_configs_are_refused(tmp_path):
    """Both used to be averaged into one cell without a word (4 'seeds' out of two
    runs and a copy, smoke runs of 6 and 200 steps together)."""
    from scripts import lra_report

    first = _run(tmp_path / "dup", "a", 0)
    copy_ = _run(tmp_path / "dup", "a_copy", 0)
    with pytest.raises(lra_report.ReportError, match="both listops sbm lambda 0 seed 0") as err:
        lra_report.check_groups(lra_report.load_summaries(str(tmp_path / "dup")))
    assert first in str(err.value) and copy_ in str(err.value)

    _run(tmp_path / "mixed", "short", 0, steps=6)
    _run(tmp_path / "mixed", "long", 1, steps=200)
    with pytest.raises(lra_report.ReportError, match="config.train.num_steps 200 -> 6"):
        lra_report.check_groups(lra_report.load_summaries(str(tmp_path / "mixed")))

    # Seeds of one config (and other lambdas beside them) are one report.
    _run(tmp_path / "ok", "s0", 0)
    _run(tmp_path / "ok", "s1", 1)
    _run(tmp_path / "ok", "l1", 0, lam=0.01)
    lra_report.check_groups(lra_report.load_summaries(str(tmp_path / "ok")))


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "lra_report.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "is not a directory"),
        ("empty", "no finished LRA run (summary.json) under"),
        ("out_is_file", "is a file, not a directory"),
        ("duplicate", "seed 0: move one out of --root"),
        ("bad_flag", "flag --num_maps"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path, case, message):
    root, out = tmp_path / "runs", tmp_path / "report"
    args = [f"--root={root}", f"--out={out}", "--num_maps=0"]
    if case != "missing":
        root.mkdir()
    if case in ("out_is_file", "duplicate"):
        _run(root, "a", 0)
    if case == "out_is_file":
        out.write_text("not a folder")
    if case == "duplicate":
        _run(root, "b", 0)
    if case == "bad_flag":
        args[-1] = "--num_maps=x"
    done = _report(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
