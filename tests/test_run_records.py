"""Run records that cannot lie, through ``scripts/train.py``: a fresh timestamped
directory per run, resume only into a run with an equal config (else one line naming
every differing field, exit 2, nothing touched), "resuming from step N", records cut
back to the restored step (never a duplicated step in metrics.jsonl, metrics.csv or
TensorBoard), a SIGTERM'd run resuming to the same losses, and summary.json describing
what was trained."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sbm_jax.training import cli
from sbm_jax.training.checkpoints import read_checkpoint_meta
from sbm_jax.training.config_checks import ConfigError
from sbm_jax.training.run_dir import RunLock
from tests import compile_cache
from tests.process_testing import xla_flags
from tests.test_metrics_tensorboard import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNTHETIC = os.path.join(ROOT, "configs", "synthetic.py")
TINY = (
    f"--config={SYNTHETIC}:full,smoke",
    "--config.task.seq_len=8",
    "--config.train.batch_size=8",
    "--config.train.log_every=1",
    "--config.task.eval_batches=1",
)


@pytest.fixture(scope="module", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """The runs here train the same tiny config again and again: compile it once."""
    directory = str(tmp_path_factory.mktemp("xla_cache"))
    with compile_cache.persistent_cache(directory):
        yield directory


def run_train(*args: str) -> tuple[int, str, str]:
    """``scripts/train.py`` in this process: (exit status, stdout, stderr)."""
    from scripts import train as train_script

    out, err = io.StringIO(), io.StringIO()
    status = cli.main(
        ["train.py", *args], task_modules=train_script.TASK_MODULES, stdout=out, stderr=err
    )
    return status, out.getvalue(), err.getvalue()


def records(output_dir, split: str | None = "train") -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if split is None or r["split"] == split]


def csv_steps(output_dir) -> list[int]:
    with open(os.path.join(output_dir, "metrics.csv"), newline="", encoding="utf-8") as f:
        return [int(float(row["step"])) for row in csv.DictReader(f)]


def snapshot(directory) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            out[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return out


def test_default_directory_is_new_per_run_and_a_changed_seed_trains_anew(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_train(*TINY, "--config.train.num_steps=3")
    assert status == 0, err
    (first,) = os.listdir(tmp_path / "runs")
    assert first.startswith("synthetic_full_smoke-")
    before = snapshot(tmp_path / "runs" / first)
    status, out, err = run_train(*TINY, "--config.train.num_steps=3", "--config.seed=1")
    assert status == 0, err
    second = sorted(set(os.listdir(tmp_path / "runs")) - {first})
    assert len(second) == 1, os.listdir(tmp_path / "runs")
    assert "resuming" not in out
    # The new run trained its own 3 steps with its own seed; the first is untouched.
    with open(tmp_path / "runs" / second[0] / "summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["seed"] == 1 and summary["steps_this_session"] == 3
    assert summary["resumed_from"] is None and summary["config"]["seed"] == 1
    assert snapshot(tmp_path / "runs" / first) == before
    assert [r["loss"] for r in records(tmp_path / "runs" / first)] != [
        r["loss"] for r in records(tmp_path / "runs" / second[0])
    ]


def test_changed_width_into_an_existing_run_exits_2_naming_the_fields(tmp_path):
    out = str(tmp_path / "run")
    status, _, err = run_train(*TINY, "--config.train.num_steps=2", f"--output_dir={out}")
    assert status == 0, err
    before = snapshot(out)
    status, stdout, err = run_train(
        *TINY,
        "--config.train.num_steps=2",
        "--config.model.emb_dim=32",
        "--config.model.head_dim=32",
        "--config.train.learning_rate=0.01",
        f"--output_dir={out}",
    )
    assert status == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for field in (
        "config.model.emb_dim 16 -> 32",
        "config.model.head_dim 16 -> 32",
        "config.train.learning_rate 0.003 -> 0.01",
    ):
        assert field in err, err
    assert "Traceback" not in err
    assert snapshot(out) == before  # nothing touched


def test_extending_a_finished_run_resumes_it_and_cuts_nothing_twice(tmp_path):
    out = str(tmp_path / "run")
    status, _, err = run_train(*TINY, "--config.train.num_steps=3", f"--output_dir={out}")
    assert status == 0, err
    assert not os.path.exists(os.path.join(out, ".lock"))  # the lock goes with the run
    saved = read_checkpoint_meta(os.path.join(out, "checkpoints", "latest", "3"))
    # train.num_steps is safe to change: the run resumes at 3 and goes on to 5.
    status, stdout, err = run_train(*TINY, "--config.train.num_steps=5", f"--output_dir={out}")
    assert status == 0, err
    assert "resuming from step 3" in stdout
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 5]
    (test,) = records(out, "test")  # the first session's test record went
    assert test["step"] in (3, 5)  # at the best dev checkpoint
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["resumed_from"] == 3 and summary["steps"] == 5
    assert summary["steps_this_session"] == 2
    # time_s counts the run's training time over both sessions: the second session's
    # steps start from the first one's time at its checkpoint, not from 0.
    times = [r["time_s"] for r in records(out)]
    assert times == sorted(times) and times[3] >= saved["wall_time_s"] > 0, (times, saved)
    # config.json keeps the run's first config; summary.json says what was trained.
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["train"]["num_steps"] == 3
    assert summary["config"]["train"]["num_steps"] == 5


def test_records_after_the_restored_step_are_cut_everywhere(tmp_path):
    """A run killed after step 6 with its newest checkpoint at 4 (as after a crash) logs
    steps 5 and 6 once, not twice, when it resumes: metrics.jsonl, metrics.csv and the
    TensorBoard events are cut back to step 4 first."""
    out = str(tmp_path / "run")
    common = (*TINY, "--config.train.num_steps=6", "--config.checkpoint.every_steps=4")
    status, _, err = run_train(*common, f"--output_dir={out}")
    assert status == 0, err
    first = records(out)
    # What a crash between checkpoint 4 and 6 leaves: records of 1..6, checkpoint 4.
    shutil.rmtree(os.path.join(out, "checkpoints", "latest", "6"))
    shutil.rmtree(os.path.join(out, "checkpoints", "best"))
    status, stdout, err = run_train(*common, f"--output_dir={out}")
    assert status == 0, err
    assert "resuming from step 4" in stdout
    again = records(out)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in again] == [r["loss"] for r in first]  # same steps, same losses
    assert csv_steps(out) == [1, 2, 3, 4, 5, 6]
    steps = [(r["split"], r["step"]) for r in records(out, None)]
    assert len(steps) == len(set(steps)), steps
    scalars, files = read_scalars(os.path.join(out, "tensorboard"))  # asserts no duplicate
    assert files == 2 and sorted(s for t, s in scalars if t == "train/loss") == [1, 2, 3, 4, 5, 6]
    assert os.path.isfile(os.path.join(out, "metrics.png"))


def test_a_crash_between_best_and_latest_and_a_shrunk_run_are_handled(tmp_path):
    """What a crash can leave and what a user can ask, each answered in the run's terms:

    * a best checkpoint of a step after the restored one (the latest of that step was
      lost) is dropped, and the test runs at the new session's best, never at a state
      the records no longer hold;
    * a damaged newest latest checkpoint is set aside for the one before;
    * ``train.num_steps`` below the run's step is refused in one line;
    * a finished run trained further loses its summary.json until it finishes again
      (a stop in between leaves no stale summary);
    * a new run says where it writes before it trains."""
    out = str(tmp_path / "run")
    common = (*TINY, "--config.checkpoint.every_steps=2")
    status, stdout, err = run_train(*common, "--config.train.num_steps=4", f"--output_dir={out}")
    assert status == 0, err
    assert stdout.startswith(f"new run in {out}\n"), stdout
    best = os.path.join(out, "checkpoints", "best")
    assert os.listdir(best) == ["4"]  # the one evaluation, at the end
    shutil.rmtree(os.path.join(out, "checkpoints", "latest", "4"))
    status, stdout, err = run_train(*common, "--config.train.num_steps=4", f"--output_dir={out}")
    assert status == 0, err
    assert "resuming from step 2" in stdout
    assert "dropped the best checkpoint of step 4, after the restored step" in stdout
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == summary["test_step"] == summary["best_dev_step"] == 4

    meta = os.path.join(out, "checkpoints", "latest", "4", "meta", "metadata")
    with open(meta, "w", encoding="utf-8") as f:
        f.write("{")
    status, stdout, err = run_train(*common, "--config.train.num_steps=4", f"--output_dir={out}")
    assert status == 0, err
    assert "warning: checkpoint 4 in" in stdout and "resuming from step 2" in stdout
    assert os.path.isdir(os.path.join(out, "checkpoints", "unreadable", "latest-4"))

    status, _, err = run_train(*common, "--config.train.num_steps=3", f"--output_dir={out}")
    assert status == 2 and err.count("\n") == 1, err
    assert "train.num_steps=3 is below step 4, where the run in" in err

    from sbm_jax.training import run_dir

    cut = run_dir.truncate_records  # a stop right after the records are cut back
    with pytest.MonkeyPatch.context() as patch:

        def stop_there(*args, **kwargs):
            cut(*args, **kwargs)
            raise KeyboardInterrupt

        patch.setattr("sbm_jax.training.resume.truncate_records", stop_there)
        status, _, _ = run_train(*common, "--config.train.num_steps=6", f"--output_dir={out}")
    assert status == 130 and not os.path.exists(os.path.join(out, "summary.json"))


def test_extending_a_decaying_schedule_says_the_rate_changes(tmp_path):
    """The schedule is rebuilt for the new num_steps (train.num_steps is safe to change):
    with a decay the rate jumps at the resume step, and the run says so."""
    out = str(tmp_path / "run")
    decay = (*TINY, "--config.train.end_learning_rate_factor=0.0")
    status, _, err = run_train(*decay, "--config.train.num_steps=2", f"--output_dir={out}")
    assert status == 0, err
    status, stdout, err = run_train(*decay, "--config.train.num_steps=4", f"--output_dir={out}")
    assert status == 0, err
    # lr 3e-3 (smoke) decays to 0 over 2 steps: 1.5e-3 at step 2 of 4 instead of 0.
    assert "note: train.num_steps 2 -> 4: the learning-rate schedule is rebuilt" in stdout
    assert "(rate at step 2: 0 -> 0.0015)" in stdout, stdout


def test_a_folder_with_records_but_no_run_is_not_overwritten(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1, "note": "my own data"}\n')
    status, _, err = run_train(*TINY, f"--output_dir={folder}")
    assert status == 2 and "holds metrics.jsonl but no config.json" in err, err
    assert "my own data" in (folder / "metrics.jsonl").read_text()


def test_a_run_folder_part_in_the_way_is_one_line_naming_the_flag_given(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "checkpoints").write_text("in the way")
    status, out, err = run_train(*TINY, "--config.train.num_steps=2", f"--output_dir={folder}")
    assert status == 2 and "Traceback" not in err, err
    assert (
        err.strip()
        == f"error: --output_dir={str(folder)!r}: checkpoints is not a directory (move it away)"
    )
    assert not (folder / "metrics.jsonl").exists()  # refused before any training
    status, out, err = run_train(
        *TINY, "--config.train.num_steps=2", f"--config.output_dir={folder}"
    )
    assert status == 2 and f"error: config.output_dir={str(folder)!r}: checkpoints" in err, err


def test_a_second_trainer_into_a_folder_in_use_is_refused(tmp_path, shared_compilation_cache):
    """The same command started twice (two terminals, a retry loop) used to run two
    trainers into one folder, interleaving their checkpoints and records."""
    out = tmp_path / "run"
    first = _launch(out, shared_compilation_cache)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None:
            if (out / "metrics.jsonl").exists() and len(records(out)) >= 2:
                break
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second started"
        status, _, err = run_train(
            *TINY,
            "--config.train.num_steps=300",
            "--config.checkpoint.every_steps=1000",
            f"--output_dir={out}",
        )
        assert status == 2 and "Traceback" not in err, err
        assert f"error: --output_dir={str(out)!r} is in use by a run that is still training" in err
        assert f"(pid {first.pid} on " in err, err
        assert first.poll() is None  # the first run goes on
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == cli.STOPPED_EXIT  # stopped by the SIGTERM, saved
    assert not (out / ".lock").exists()  # the lock (and its file) went with the first run
    RunLock(str(out)).release()


def test_run_lock_is_exclusive_and_released(tmp_path):
    held = RunLock(str(tmp_path))
    with pytest.raises(ConfigError, match=f"pid {os.getpid()} on "):
        RunLock(str(tmp_path))
    held.release()
    RunLock(str(tmp_path)).release()


def _launch(output_dir, cache: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **compile_cache.env(cache))
    env["XLA_FLAGS"] = xla_flags()  # the suite's compile flags, no device count
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "train.py"),
            *TINY,
            "--config.train.num_steps=300",
            "--config.checkpoint.every_steps=1000",
            f"--output_dir={output_dir}",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # suite time (15 min): test_resilience's SIGTERM resume stays in the default run
def test_sigterm_saves_and_the_resumed_run_repeats_the_losses(tmp_path, shared_compilation_cache):
    run_dir, ref_dir = tmp_path / "run", tmp_path / "straight"
    cache = shared_compilation_cache
    reference = _launch(ref_dir, cache)
    proc = _launch(run_dir, cache)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            path = run_dir / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == cli.STOPPED_EXIT, err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1 and "(SIGTERM)" in stopped[0], out
    k = int(stopped[0].split()[3])
    assert 3 <= k < 300 and "Traceback" not in err
    assert [r["step"] for r in records(run_dir)] == list(range(1, k + 1))
    assert (run_dir / "checkpoints" / "latest" / str(k)).is_dir()
    assert not (run_dir / "summary.json").exists()

    resumed = _launch(run_dir, cache)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming from step {k}" in out
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err[-3000:]
    a, b = records(ref_dir), records(run_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 301))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit on CPU
    assert csv_steps(run_dir) == list(range(1, 301))


BAD_INPUTS = [
    (
        ("--config.model.attention_options.delta=-1",),
        "config.model.attention_options.delta must lie in [0, 1] (a probability), got -1",
    ),
    (
        ("--config.model.attention_options.edge_law=gauss",),
        "config.model.attention_options.edge_law",
    ),
    (("--config.model.attention_options.impl=fast",), "config.model.attention_options.impl"),
    (
        ("--config.model.attention_options.capacity_buckets=(0.5, 0.25)",),
        "config.model.attention_options.capacity_buckets must be strictly increasing",
    ),
    (
        ("--config.train.nonexistent=1",),
        "config.train.nonexistent is not a field of this config; did you mean config.train.",
    ),
    (("--config.train.num_step=5",), "did you mean config.train.num_steps?"),
    (
        ("--config.train.warmup_steps=100", "--config.train.num_steps=10"),
        "config.train.warmup_steps=100 exceeds train.num_steps=10",
    ),
    (("--config.task.name=synthetik",), "did you mean 'synthetic'?"),
    (("--config.model.attention=sbmm",), "config.model.attention='sbmm' is not a known"),
    (
        ("--config.model.attention=performer",),  # the SBM preset's options stay behind
        "['cluster_init', 'delta', 'dense_below', 'edge_cost', 'edge_law', 'impl', "
        "'num_clusters', 'self_loops', 'shared_mlp', 'ste'] are not options of attention "
        "'performer' (another mechanism's options",
    ),
    (("--config.mesh.heads=3",), "config.mesh.heads=3"),
    (("--config.init_from=/no/such/run",), "config.init_from='/no/such/run' does not exist"),
    (("--bogus=1",), "unknown flag --bogus"),
]


@pytest.mark.parametrize("extra, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(extra, message, tmp_path):
    out = tmp_path / "run"
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke", *extra, f"--output_dir={out}"
    )
    assert status == 2 and stdout == "", (stdout, err)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    assert not out.exists()  # checked before anything is created


def test_bad_preset_and_missing_config_file(tmp_path):
    status, _, err = run_train(f"--config={SYNTHETIC}:bogus")
    assert status == 2 and err.count("\n") == 1 and "unknown preset 'bogus'" in err
    status, _, err = run_train(f"--config={tmp_path / 'nope.py'}")
    assert status == 2 and err.count("\n") == 1 and "no such file" in err
    status, _, err = run_train()
    assert status == 2 and "--config is required" in err
    status, _, err = run_train("--config=no_such_preset:quick")
    assert status == 2 and err.count("\n") == 1 and "no preset of that name" in err


def test_presets_are_found_by_name_as_an_installed_package_finds_them(tmp_path, monkeypatch):
    from sbm_jax.training.cli import load_config_file, resolve_config_path

    monkeypatch.chdir(tmp_path)  # not the checkout: configs/ is not a relative path here
    by_path = load_config_file(f"{SYNTHETIC}:sbm,smoke")
    for spec in ("synthetic:sbm,smoke", "synthetic.py:sbm,smoke", "configs/synthetic.py:sbm,smoke"):
        assert load_config_file(spec).to_dict() == by_path.to_dict(), spec
    listops = resolve_config_path("lra/listops")
    assert listops is not None and listops.endswith(os.path.join("configs", "lra", "listops.py"))
    assert resolve_config_path("lra/nothing") is None
    status, out, err = run_train("--config=synthetic:full,smoke", "--print_config")
    assert status == 0 and "attention: full" in out, err


def test_a_task_module_without_its_dependency_leaves_the_other_tasks(tmp_path, monkeypatch):
    """With GLUE's tokenizers not installed (only the LRA extra), the synthetic task still
    trains, and a task no module registered names the skipped module and what it lacks,
    in one line."""
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "broken_project_import.py").write_text("import sbm_jax.no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = ("lra.train_task", "needs_missing_dep")

    def run(*args: str, task_modules=modules) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        status = cli.main(["train.py", *args], task_modules=task_modules, stdout=out, stderr=err)
        return status, out.getvalue(), err.getvalue()

    status, out, err = run(f"--config={SYNTHETIC}:sbm,smoke", "--print_config")
    assert status == 0 and "num_steps: 40" in out, err
    # (The name of a task no module here registers: another test may import glue.tasks.)
    status, _, err = run(
        f"--config={SYNTHETIC}:sbm,smoke", "--config.task.name=missing_dep_task", "--print_config"
    )
    assert status == 2 and err.count("\n") == 1, err
    assert "task.name='missing_dep_task' is not a known task" in err
    assert "needs_missing_dep (no module named 'no_such_dependency_xyz')" in err
    # A missing module of the project itself is a bug: raised, not skipped.
    with pytest.raises(ModuleNotFoundError, match="sbm_jax.no_such_module"):
        run(f"--config={SYNTHETIC}:sbm,smoke", task_modules=("broken_project_import",))


def test_a_task_name_whose_fields_the_config_lacks_is_one_line(tmp_path):
    status, _, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke",
        "--config.task.name=glue_sst2",
        f"--output_dir={tmp_path / 'run'}",
    )
    assert status == 2 and err.count("\n") == 1, err
    assert "config.task.name='glue_sst2': this config lacks config.data" in err, err
    assert not (tmp_path / "run").exists()


def test_lra_config_errors_come_before_any_data_is_generated(tmp_path):
    listops = os.path.join(ROOT, "configs", "lra", "listops.py")
    data_dir = tmp_path / "data"
    status, _, err = run_train(
        f"--config={listops}:sbm,smoke",
        f"--config.task.data_dir={data_dir}",
        "--config.train.warmup_steps=50",
        f"--output_dir={tmp_path / 'run'}",
    )
    assert status == 2 and err.count("\n") == 1, err
    assert "config.train.warmup_steps=50 exceeds train.num_steps=6" in err
    assert not data_dir.exists() and not (tmp_path / "run").exists()
    # ListOps sizes that cannot be met fail at once, before generating anything.
    status, _, err = run_train(
        f"--config={listops}:sbm,smoke",
        f"--config.task.data_dir={data_dir}",
        "--config.task.generate.min_length=3",
        "--config.task.generate.max_length=5",
        "--config.task.generate.num_train=500",
        f"--output_dir={tmp_path / 'run'}",
    )
    assert status == 2 and err.count("\n") == 1, err
    assert "only 400 such expressions exist" in err
    assert not data_dir.exists()


def test_over_long_sequences_exit_2_unless_truncation_is_asked(tmp_path):
    listops = os.path.join(ROOT, "configs", "lra", "listops.py")
    common = (
        f"--config={listops}:full,smoke",
        f"--config.task.data_dir={tmp_path / 'data'}",
        "--config.task.max_length=16",
        "--config.train.num_steps=1",
    )
    status, stdout, err = run_train(*common, f"--output_dir={tmp_path / 'a'}")
    assert status == 2 and err.count("\n") == 1, err
    assert "train examples of" in err and "lra_listops" in err
    assert "longer than task.max_length=16 (the longest has" in err
    status, stdout, err = run_train(
        *common, "--config.task.truncate=True", f"--output_dir={tmp_path / 'b'}"
    )
    assert status == 0, err
    assert "task.truncate=True: cutting" in stdout


def test_print_config_lists_the_fields_and_validates(tmp_path):
    status, out, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke",
        "--config.model.attention_options.capacity_buckets=(0.05, 0.5)",
        "--print_config",
    )
    assert status == 0, err
    assert "num_steps: 40" in out and "capacity_buckets" in out and "0.05" in out
    status, out, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke",
        "--config.model.attention_options.delta=-1",
        "--print_config",
    )
    # The error alone: not after a screen of config.
    assert status == 2 and out == "" and "delta must lie in [0, 1]" in err
    status, out, err = run_train(f"--config={SYNTHETIC}:sbm,smoke", "--dry_run")
    assert status == 0 and "would train a new run in runs/synthetic_sbm_smoke-" in out
    status, out, _ = run_train("--help")
    assert status == 0 and "--print_config" in out and "To list a preset's fields" in out
    # The LRA run name carries the seed: --config.seed (as configs/lra/common.py's
    # docstring shows it) names the run as seed= in the preset would; --config.name wins.
    lra = os.path.join(os.path.dirname(SYNTHETIC), "lra", "listops.py")
    status, out, err = run_train(f"--config={lra}:sbm,smoke", "--config.seed=3", "--dry_run")
    assert status == 0 and "new run in runs/lra_listops_sbm_smoke_seed3-" in out, err
    status, out, err = run_train(
        f"--config={lra}:sbm,smoke,seed=2", "--config.seed=5", "--config.name=mine", "--dry_run"
    )
    assert status == 0 and "new run in runs/mine-" in out, err


def test_options_whose_default_is_none_are_set_from_the_command_line(tmp_path):
    """sparse_fixed's c and stride, reformer's num_buckets and sbm's edge_cost default to
    None (a rule computes them): the command line still sets them, with their type."""
    lra = os.path.join(os.path.dirname(SYNTHETIC), "lra", "listops.py")
    for preset, option, value, shown in (
        ("sparse_fixed,smoke", "c", "4", "c: 4"),  # <= the default stride at length 32
        ("sparse_strided,smoke", "stride", "8", "stride: 8"),
        ("reformer,smoke", "num_buckets", "4", "num_buckets: 4"),
        ("sbm,smoke", "edge_cost", "3", "edge_cost: 3.0"),  # a float option given an int
    ):
        status, out, err = run_train(
            f"--config={lra}:{preset}",
            f"--config.model.attention_options.{option}={value}",
            "--print_config",
        )
        assert status == 0, err
        assert f"\n    {shown}\n" in out, out
    # Bad values that the mechanisms check when built (or in validate()) are named in
    # one line before anything runs, not as a traceback from the first trace.
    tsa = os.path.join(os.path.dirname(SYNTHETIC), "tsa_text.py")
    for spec, option, message in (
        (f"{lra}:sparse_strided,smoke", "impl=blockd", "impl='blockd' must be one of"),
        (f"{lra}:sparse_fixed,smoke", "c=0", "attention_options.c must be an int >= 1, got 0"),
        (f"{lra}:performer,smoke", "kernel=relux", "kernel must be one of ('relu', 'softmax')"),
        (f"{tsa}:smoke", "damping=1.5", "attention_options.damping=1.5 must lie in (0, 1)"),
        (f"{tsa}:smoke", "projection=ttt", "attention_options.projection='ttt' must be one"),
    ):
        status, _, err = run_train(
            f"--config={spec}", f"--config.model.attention_options.{option}", "--dry_run"
        )
        assert status == 2 and err.count("\n") == 1, err
        assert err.startswith("error: config.model.") and message in err, err
    # A value of the wrong type is still named in one line.
    status, _, err = run_train(
        f"--config={lra}:sparse_fixed,smoke", "--config.model.attention_options.c=many"
    )
    assert status == 2 and err.count("\n") == 1 and "attention_options.c" in err, err


@pytest.mark.slow  # compiles SBM's sparse path: about a minute of CPU
def test_capacity_buckets_from_the_command_line_and_overflow_is_counted(tmp_path):
    """SBM options the preset does not list (capacity_buckets, max_dense_elements) are
    set on the command line and trained with: one bucket of 1% of n*m (3 slots at
    n=16) and no dense fallback. Every graph draws ~0.3 * 256 edges, far above 3, so
    every (example, head) graph of every step overflows: 16 per step (batch 16, one
    head, one layer). The trainer counts them, warns once naming the layer and the
    step, and summary.json carries the total. (The bucketed kernel: the fused one, the
    CPU default, has no capacity.)"""
    out = tmp_path / "run"
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke",
        "--config.model.attention_options.impl=sparse",
        "--config.model.attention_options.kernel=rows",
        "--config.model.attention_options.capacity_buckets=(0.01,)",
        "--config.model.attention_options.max_dense_elements=0",
        "--config.train.num_steps=3",
        "--config.train.log_every=1",
        f"--output_dir={out}",
    )
    assert status == 0, err
    with open(out / "summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    options = summary["config"]["model"]["attention_options"]
    assert options["capacity_buckets"] == [0.01] and options["max_dense_elements"] == 0
    train = records(out)
    assert [r["overflow"] for r in train] == [16.0, 16.0, 16.0]
    evaluated = [r for r in records(out, None) if r["split"] != "train"]
    assert evaluated and all(r["overflow"] == 16.0 for r in evaluated)  # one eval batch each
    assert summary["overflow_total"] == 16.0 * (len(train) + len(evaluated))
    warnings = [line for line in stdout.splitlines() if line.startswith("warning: SBM")]
    assert len(warnings) == 1, stdout
    assert "train step 1 in encoder/block_0/attention (16)" in warnings[0]


def test_overflow_is_counted_warned_once_and_totalled(tmp_path):
    """The trainer's side of SBM's overflow, with a stand-in layer that sows
    ``attention_stats/overflow [batch, heads]`` as SBM does: 1 for the two heads of
    every example whose first token exceeds 4, 0 elsewhere. The counts are checked
    against numpy on the same batches."""
    import dataclasses

    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np

    from configs import synthetic as synthetic_config
    from sbm_jax.attention import STATS_COLLECTION
    from sbm_jax.tasks import build_task
    from sbm_jax.training import train_and_evaluate

    class StandIn(nn.Module):
        @nn.compact
        def __call__(self, inputs):
            hit = inputs[:, :1] > 4  # [batch, 1]
            self.sow(STATS_COLLECTION, "overflow", jnp.tile(hit, (1, 2)))
            self.sow(STATS_COLLECTION, "density", jnp.full((inputs.shape[0], 2), 0.5))
            return nn.Embed(16, 2)(inputs)

    class Overflowing(nn.Module):
        @nn.compact
        def __call__(self, inputs, mask, *, deterministic):
            del mask, deterministic
            return nn.Dense(2)(StandIn(name="attention")(inputs))

    config = synthetic_config.get_config("full,smoke")
    config.task.seq_len = 8
    config.train.batch_size = 8
    config.train.num_steps = 3
    config.train.log_every = 1
    config.task.eval_batches = 1
    task = dataclasses.replace(build_task(config), make_model=lambda model: Overflowing())
    log = io.StringIO()
    summary = train_and_evaluate(config, task, str(tmp_path / "run"), log_stream=log)
    expected = [
        2.0 * float(np.sum(next(task.train_batches(s))["inputs"][:, 0] > 4)) for s in range(3)
    ]
    train = records(tmp_path / "run")
    assert [r["overflow"] for r in train] == expected
    evaluated = [r for r in records(tmp_path / "run", None) if r["split"] != "train"]
    assert [r["split"] for r in evaluated] == ["dev", "test"]
    split_batches = (task.eval_batches, task.test_splits["test"])
    counts = [2.0 * float(np.sum(next(iter(f()))["inputs"][:, 0] > 4)) for f in split_batches]
    assert [r["overflow"] for r in evaluated] == counts
    assert summary["overflow_total"] == sum(expected) + sum(counts)
    warnings = [line for line in log.getvalue().splitlines() if line.startswith("warning:")]
    first = next(s for s, count in enumerate(expected, start=1) if count > 0)
    assert len(warnings) == 1, log.getvalue()
    assert f"train step {first} in attention ({expected[first - 1]:g})" in warnings[0]

    # Resumed to step 6: the new session's log first says how many graphs overflowed
    # before, then warns again at its own first overflowing step; the total counts every
    # record the run keeps (the first session's test record is replaced).
    config.train.num_steps = 6
    log = io.StringIO()
    summary = train_and_evaluate(config, task, str(tmp_path / "run"), log_stream=log)
    lines = log.getvalue().splitlines()
    (note,) = [line for line in lines if "overflowed the largest capacity bucket" in line]
    assert note.startswith("note: ") and "before this resume" in note
    later = [
        2.0 * float(np.sum(next(task.train_batches(s))["inputs"][:, 0] > 4)) for s in (3, 4, 5)
    ]
    train = records(tmp_path / "run")
    assert [r["overflow"] for r in train] == expected + later
    kept = records(tmp_path / "run", None)
    assert summary["overflow_total"] == sum(r["overflow"] for r in kept)
    warnings = [line for line in lines if line.startswith("warning:")]
    step = next(s for s, count in enumerate(later, start=4) if count > 0)  # the data has one
    assert len(warnings) == 1 and f"train step {step} in attention" in warnings[0]


def test_config_differences_name_every_field_and_allow_the_safe_ones():
    from sbm_jax.training.run_dir import config_differences

    saved = {
        "seed": 0,
        "model": {"emb_dim": 16, "attention_options": {"capacity_buckets": [0.1, 0.5]}},
        "train": {"num_steps": 10, "learning_rate": 0.1},
        "mesh": {"data": 1},
    }
    new = {
        "seed": 1,
        "model": {"emb_dim": 16, "attention_options": {"capacity_buckets": [0.1, 0.25]}},
        "train": {"num_steps": 20, "learning_rate": 0.1, "halt_on_nonfinite": True},
        "mesh": {"data": 4},
        "extra": 3,
    }
    assert config_differences(saved, new) == [
        "config.extra (none) -> 3",
        "config.model.attention_options.capacity_buckets [0.1, 0.5] -> [0.1, 0.25]",
        "config.seed 0 -> 1",
    ]  # num_steps and mesh are safe; a field new since the run, at its old behaviour, too
    assert config_differences(saved, saved) == []
    assert config_differences({"a": 1}, {"a": True}) == ["config.a 1 -> true"]


def test_runs_saved_before_the_encoder_options_resume_at_their_old_behaviour():
    from sbm_jax.training.run_dir import config_differences

    saved = {"model": {"emb_dim": 16, "attention_options": {"delta": 0.01}}}
    new = {
        "model": {
            "emb_dim": 16,
            "position_embedding": "learned",
            "final_norm": True,
            "query_key_init": "tied",  # init only: a resumed run restores its parameters
            "attention_options": {"delta": 0.01, "ste": "paper", "kernel": "rows"},
        }
    }
    assert config_differences(saved, new) == []
    new["model"]["final_norm"] = False
    new["model"]["attention_options"]["ste"] = "reference"
    assert config_differences(saved, new) == [
        'config.model.attention_options.ste (none) -> "reference"',
        "config.model.final_norm (none) -> false",
    ]


def test_summary_and_config_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A kill during the write of summary.json left a truncated file, which the sweep
    took for a finished run and the report could not read. The run's JSON files go
    through a temporary file and a rename: the old file or the new one, never half."""
    from sbm_jax.training import run_dir

    path = tmp_path / "summary.json"
    path.write_text('{"old": true}')

    def killed(src, dst):
        raise KeyboardInterrupt  # the process dies between the write and the rename

    monkeypatch.setattr(run_dir.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run_dir.write_atomically(str(path), '{"new": true, "long": "' + "x" * 100_000 + '"}')
    assert json.loads(path.read_text()) == {"old": True}
    monkeypatch.undo()
    run_dir.write_atomically(str(path), '{"new": true}')
    assert json.loads(path.read_text()) == {"new": True}
    out = str(tmp_path / "run")
    status, _, err = run_train(*TINY, "--config.train.num_steps=2", f"--output_dir={out}")
    assert status == 0, err
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_the_summary_names_the_init_checkpoint_the_run_started_from(tmp_path):
    """init_from names a run; its best checkpoint may change before this run resumes.
    The summary used to name whatever the lookup found in the last session."""
    pre, tuned = str(tmp_path / "pre"), str(tmp_path / "tuned")
    assert run_train(*TINY, "--config.train.num_steps=2", f"--output_dir={pre}")[0] == 0
    (step,) = os.listdir(os.path.join(pre, "checkpoints", "best"))
    used = os.path.join(pre, "checkpoints", "best", step)
    first = (*TINY, f"--config.init_from={pre}", f"--output_dir={tuned}")
    assert run_train(*first, "--config.train.num_steps=1")[0] == 0
    shutil.copytree(used, os.path.join(pre, "checkpoints", "best", "9"))  # a newer best
    status, stdout, err = run_train(*first, "--config.train.num_steps=2")
    assert status == 0 and "resuming from step 1" in stdout, err
    with open(os.path.join(tuned, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["init_from"] == used
