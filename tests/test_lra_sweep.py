"""scripts/lra_sweep.py resolves everything against --root, wherever it starts from."""

from __future__ import annotations

import json
import os

import pytest
from absl import flags

from tests.scripts_testing import forget_script


def test_sweep_paths_live_under_root_from_any_directory(tmp_path, monkeypatch, capsys):
    from scripts import lra_sweep

    calls = []
    monkeypatch.setattr(lra_sweep.subprocess, "Popen", _fake_trainer(calls, lra_sweep))
    start = tmp_path / "elsewhere"
    start.mkdir()
    monkeypatch.chdir(start)
    argv = ["lra_sweep", "--tasks=listops", "--mechanisms=full", "--root=sweep", "--scale=smoke"]
    flags.FLAGS(argv)
    try:
        lra_sweep.main(["lra_sweep"])
        run = start / "sweep" / "listops" / "full_lambda0_seed0"
        ((cmd, cwd, log, out),) = calls
        assert out == str(run) and os.path.isabs(out)
        assert log == str(run / "train.log")
        assert cwd is None  # the run starts where the sweep did, like its paths
        assert any(a.startswith("--config=/") for a in cmd)  # the config by absolute path
        # From another directory, the same (absolute) root is seen as done: skipped.
        monkeypatch.chdir(tmp_path)
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*argv[:-2], f"--root={start / 'sweep'}", "--scale=smoke"])
        lra_sweep.main(["lra_sweep"])
        assert len(calls) == 1
        # A dry run lists what a real run would do: the finished run as skipped, a new
        # seed's command printed, and nothing started.
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*argv[:-2], f"--root={start / 'sweep'}", "--scale=smoke", "--seeds=0,1"])
        flags.FLAGS.dry_run = True
        capsys.readouterr()
        lra_sweep.main(["lra_sweep"])
        printed = capsys.readouterr().out.splitlines()
        assert printed[0] == f"skip (done): {run}"
        assert len(printed) == 2 and "seed=1" in printed[1] and "full_lambda0_seed1" in printed[1]
        assert len(calls) == 1
    finally:
        flags.FLAGS.unparse_flags()
        forget_script("scripts.lra_sweep")


def _fake_trainer(calls: list, lra_sweep, finish: bool = True):
    """A stand-in for the trainer's process: it writes the run's config.json (the config
    the command asks for, as train.py would) and, with ``finish``, summary.json."""

    class FakeTrainer:
        def __init__(self, cmd, stdout, stderr, **kwargs):
            out = next(a for a in cmd if a.startswith("--output_dir=")).split("=", 1)[1]
            calls.append((cmd, kwargs.get("cwd"), stdout.name, out))
            with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
                json.dump(lra_sweep.requested_config(cmd), f)
            if finish:
                with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
                    f.write("{}")

        def wait(self):
            return 0 if finish else lra_sweep.STOPPED_EXIT  # as the trainer exits

        def poll(self):
            return self.wait()

    return FakeTrainer


def test_a_finished_run_of_another_config_is_not_done_and_a_stopped_one_is_unfinished(
    tmp_path, monkeypatch, capsys
):
    """A sweep at another --scale (or with other overrides) on the same root used to skip
    the finished runs as done, and lra_report then reported smoke numbers as paper ones;
    a trainer stopped by a signal (exit 75, no summary.json) is unfinished, not failed."""
    from scripts import lra_sweep

    calls = []
    monkeypatch.setattr(lra_sweep.subprocess, "Popen", _fake_trainer(calls, lra_sweep))
    base = ["lra_sweep", "--tasks=listops", "--mechanisms=full", f"--root={tmp_path}"]
    try:
        flags.FLAGS([*base, "--scale=smoke"])
        lra_sweep.main(["lra_sweep"])
        assert len(calls) == 1
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*base, "--scale=smoke"])
        lra_sweep.main(["lra_sweep"])
        assert len(calls) == 1  # the same config: done
        capsys.readouterr()
        for other in (
            ["--scale=reduced"],
            ["--scale=smoke", "--override=--config.train.num_steps=9"],
        ):
            flags.FLAGS.unparse_flags()
            flags.FLAGS([*base, *other, "--dry_run"])
            lra_sweep.main(["lra_sweep"])
            printed = capsys.readouterr().out
            assert "skip (done)" not in printed and "finished with another config" in printed
        assert "config.train.num_steps 6 -> 9" in printed, printed

        stopped = []
        monkeypatch.setattr(
            lra_sweep.subprocess, "Popen", _fake_trainer(stopped, lra_sweep, finish=False)
        )
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*base, "--scale=smoke", "--seeds=1"])
        with pytest.raises(SystemExit) as exit_info:
            lra_sweep.main(["lra_sweep"])
        assert exit_info.value.code == 1 and len(stopped) == 1
        captured = capsys.readouterr()
        assert "stopped before the end" in captured.out
        assert "1 run(s) unfinished" in captured.err and "failed" not in captured.err
        from sbm_jax.training import cli

        assert lra_sweep.STOPPED_EXIT == cli.STOPPED_EXIT
    finally:
        flags.FLAGS.unparse_flags()
        forget_script("scripts.lra_sweep")


@pytest.mark.slow  # ~1 min: two sweeps of a real (smoke) ListOps run
def test_ctrl_c_to_the_sweep_saves_the_running_trainer_and_the_rerun_finishes(tmp_path):
    """Ctrl-C used to SIGKILL the trainer 0.25 s later (no checkpoint of the last steps)
    and print a traceback; SIGTERM to the sweep alone left the trainer running orphaned."""
    import signal
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [
        sys.executable,
        os.path.join(root, "scripts", "lra_sweep.py"),
        "--tasks=listops",
        "--mechanisms=full",
        "--scale=smoke",
        f"--root={tmp_path / 'sweep'}",
        f"--override=--config.task.data_dir={tmp_path / 'data'}",
        "--override=--config.train.num_steps=400",
        "--override=--config.train.log_every=1",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    run = tmp_path / "sweep" / "listops" / "full_lambda0_seed0"
    sweep = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and sweep.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        assert sweep.poll() is None, "the run ended before it could be interrupted"
        sweep.send_signal(signal.SIGINT)
        out, err = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 128 + signal.SIGINT, (out, err)
    assert "sweep stopped by SIGINT; the same command resumes it" in err and "Traceback" not in err
    log = (run / "train.log").read_text()
    assert "stopped at step" in log and "(SIGINT)" in log, log[-2000:]
    assert not (run / "summary.json").exists()
    assert any((run / "checkpoints" / "latest").iterdir())

    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from step" in (run / "train.log").read_text()
    assert (run / "summary.json").exists()
