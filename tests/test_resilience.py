"""Preemption and failure handling of the full trainer: SIGTERM -> checkpoint -> resume
gives the uninterrupted loss sequence bit for bit; a NaN step halts the run with the
state before it, its batch and rng saved, and the dump replays to the same NaN."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from sbm_jax.models import build_model
from sbm_jax.training.checkpoints import RunCheckpoints, restore_snapshot
from sbm_jax.training.nonfinite import NonFiniteError, replay_nonfinite
from sbm_jax.training.preemption import StopSignals
from sbm_jax.training.state import create_train_state
from sbm_jax.training.trainer import train_and_evaluate
from tests import resilience_task
from tests.process_testing import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "resilience_task.py")


def _records(output_dir, split: str = "train") -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _launch(output_dir, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env["XLA_FLAGS"] = xla_flags()  # the suite's compile flags, no device count
    return subprocess.Popen(
        [sys.executable, SCRIPT, str(output_dir), *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, dict, str]:
    out, _ = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT ") :]) if lines else {}
    return proc.returncode, result, out


def _interrupt_and_resume(tmp_path, attention: str, steps: int = 8, at_least: int = 3):
    ref_dir, run_dir = tmp_path / "straight", tmp_path / "interrupted"
    common = (f"--steps={steps}", f"--attention={attention}")
    reference = _launch(ref_dir, *common)
    slow = _launch(run_dir, *common, "--sleep=0.4")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and slow.poll() is None:
            path = run_dir / "metrics.jsonl"
            if path.exists() and any(r["step"] >= at_least for r in _records(run_dir)):
                break
            time.sleep(0.1)
        assert slow.poll() is None, "the run ended before it could be interrupted"
        slow.send_signal(signal.SIGTERM)
        code, stopped, out = _finish(slow)
    finally:
        for proc in (slow, reference):
            if proc.poll() is None and proc is slow:
                proc.kill()
    assert code == 0, out[-3000:]
    assert stopped["reason"] == "SIGTERM", out[-3000:]
    k = stopped["stopped_at"]
    assert at_least <= k < steps
    assert (run_dir / "checkpoints" / "latest" / str(k)).is_dir()
    assert not (run_dir / "summary.json").exists()
    assert [r["step"] for r in _records(run_dir)] == list(range(1, k + 1))
    with open(run_dir / "checkpoints" / "latest" / str(k) / "meta" / "metadata") as f:
        meta = json.load(f)
    assert meta["data_index"] == k and meta["batch_size"] == 8

    code, resumed, out = _finish(_launch(run_dir, *common))
    assert code == 0 and resumed["resumed_from"] == k and resumed["steps"] == steps, out[-3000:]
    code, straight, out = _finish(reference)
    assert code == 0 and straight["resumed_from"] is None, out[-3000:]

    a, b = _records(ref_dir), _records(run_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    # Exact float equality (CPU): same params, optimizer state, rng and batches.
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    if attention == "sbm":
        assert [r["density"] for r in a] == [r["density"] for r in b]
    assert _records(ref_dir, "test")[0]["loss"] == _records(run_dir, "test")[0]["loss"]


def test_sigterm_checkpoints_and_resume_is_bit_exact(tmp_path):
    _interrupt_and_resume(tmp_path, "full")


@pytest.mark.slow
def test_sigterm_resume_is_bit_exact_with_sbm_sampling(tmp_path):
    _interrupt_and_resume(tmp_path, "sbm")


def test_a_hang_up_saves_and_exits_cleanly_though_the_terminal_is_gone(tmp_path):
    """An ssh session that drops without ``nohup``: the trainer gets SIGHUP and its
    terminal is gone (writes to it fail with EIO). It must save and exit 0 like SIGTERM,
    not die unsaved (SIGHUP's default) or crash on its next progress line."""
    import pty
    import select

    run_dir = tmp_path / "run"
    master, slave = pty.openpty()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env["XLA_FLAGS"] = xla_flags()
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, str(run_dir), "--steps=8", "--attention=full", "--sleep=0.4"],
        env=env,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.1)[0]:
                os.read(master, 65536)  # keep the terminal's buffer from filling
            path = run_dir / "metrics.jsonl"
            if path.exists() and any(r["step"] >= 3 for r in _records(run_dir)):
                break
        assert proc.poll() is None, "the run ended before it could be interrupted"
        os.close(master)  # the terminal hangs up: the trainer's writes now fail
        master = -1
        proc.send_signal(signal.SIGHUP)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        if master >= 0:
            os.close(master)
    assert code == 0, f"exit status {code}"
    k = max(r["step"] for r in _records(run_dir))
    assert 3 <= k < 8 and (run_dir / "checkpoints" / "latest" / str(k)).is_dir()
    assert [r["step"] for r in _records(run_dir)] == list(range(1, k + 1))
    assert not (run_dir / "summary.json").exists()  # stopped, not finished


def test_stop_signals_restore_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("outer"))
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert signals.received == "SIGTERM" and seen == []
            os.kill(os.getpid(), signal.SIGTERM)  # a second one reaches the old handler
            time.sleep(0.01)
            assert seen == ["outer"]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert seen == ["outer", "outer"]
    finally:
        signal.signal(signal.SIGTERM, previous)


# suite time (~18 s: a full run to the non-finite step, then its replay); run with -m slow.
@pytest.mark.slow
def test_nonfinite_step_halts_with_replayable_state(tmp_path):
    """Batch 4 (metrics step 5) is poisoned; metrics flush every 3 steps, so the host
    learns of it at step 6, after one more (skipped) update."""
    config = resilience_task.make_config("full", num_steps=8)
    config.train.log_every = 3
    task = resilience_task.poisoned(resilience_task.make_task(config), poison_index=4)

    with pytest.raises(NonFiniteError) as info:
        train_and_evaluate(config, task, str(tmp_path / "bad"))
    error = info.value
    assert error.step == 5
    assert "step 5" in str(error) and error.directory in str(error)
    assert error.directory == str(tmp_path / "bad" / "nonfinite" / "step_5")
    assert not (tmp_path / "bad" / "summary.json").exists()
    logged = _records(tmp_path / "bad")
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    # metrics.jsonl is strict JSON: the NaN loss is written as null.
    assert logged[-1]["nonfinite"] and logged[-1]["loss"] is None
    with open(os.path.join(error.directory, "info.json"), encoding="utf-8") as f:
        dump = json.load(f)
    assert (dump["step"], dump["data_index"], dump["state_step"]) == (5, 4, 4)
    assert dump["loss"] == "nan"
    with np.load(os.path.join(error.directory, "batch.npz")) as saved:
        assert np.isnan(saved["poison"]).all()
        np.testing.assert_array_equal(saved["__rows__"], np.arange(8))

    # Reference: the same run stopped cleanly after 4 steps (the poison is never read).
    stopped = train_and_evaluate(config, task, str(tmp_path / "clean"), stop_after=4)
    assert stopped == {
        "stopped_at": 4,
        "output_dir": str(tmp_path / "clean"),
        "reason": "stop_after",
    }
    clean = _records(tmp_path / "clean")
    assert [r["loss"] for r in clean] == [r["loss"] for r in logged[:4]]

    model = build_model(config.model, task.head)
    target = create_train_state(config, model, task, next(task.train_batches(0)))
    saved, meta = restore_snapshot(os.path.join(error.directory, "state"), target)
    checkpoints = RunCheckpoints(str(tmp_path / "clean" / "checkpoints"))
    after4, _ = checkpoints.restore_latest(target)
    checkpoints.close()
    assert int(saved.step) == int(after4.step) == 4 and meta["data_index"] == 4
    same = jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))),
        (saved.params, saved.opt_state, jax.random.key_data(saved.rng)),
        (after4.params, after4.opt_state, jax.random.key_data(after4.rng)),
    )
    assert all(jax.tree.leaves(same))

    replay = replay_nonfinite(error.directory, config, task)
    assert (replay["step"], replay["data_index"], replay["state_step"]) == (5, 4, 4)
    assert not replay["finite"] and np.isnan(replay["loss"])
    assert np.isfinite(replay["grad_norm"])  # the poison is a constant: only the loss is NaN


def test_replay_from_the_dump_alone(tmp_path):
    """The replay line the trainer prints (``replay_nonfinite(DIR)``) needs no config or
    task in hand: both come from the run's config.json, the task by its registered name.
    A learning rate of 1e38 makes the second step's loss overflow."""
    from configs import synthetic
    from sbm_jax.tasks import build_task

    config = synthetic.get_config("full,smoke")
    config.train.learning_rate = 1e38
    config.train.warmup_steps = 0
    config.train.num_steps = 4
    config.train.log_every = 1
    with pytest.raises(NonFiniteError) as info:
        train_and_evaluate(config, build_task(config), str(tmp_path / "run"))
    error = info.value
    assert f"replay_nonfinite({error.directory!r})" in str(error)
    replay = replay_nonfinite(error.directory)
    assert replay["step"] == error.step and not replay["finite"]
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        replay_nonfinite(str(tmp_path / "elsewhere" / "nonfinite" / "step_1"))
