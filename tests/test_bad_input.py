"""Bad input that once got through the trainer's checks, and what it gets now: one line
naming the field (exit 2, nothing created), strict-JSON records, a stopped run's own
exit status, no lock file left behind, the trainer's small conveniences (``--workdir``,
``--list_presets``). In this process: no child is started."""

from __future__ import annotations

import io
import json
import math
import os

import pytest

from sbm_jax.training import cli, step_size
from sbm_jax.training.metrics import MetricsWriter
from sbm_jax.training.run_dir import RunLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNTHETIC = os.path.join(ROOT, "configs", "synthetic.py")


def run_train(*args: str) -> tuple[int, str, str]:
    """``scripts/train.py`` in this process: (exit status, stdout, stderr)."""
    from scripts import train as train_script

    out, err = io.StringIO(), io.StringIO()
    status = cli.main(
        ["train.py", *args], task_modules=train_script.TASK_MODULES, stdout=out, stderr=err
    )
    return status, out.getvalue(), err.getvalue()


def assert_one_line(status: int, stdout: str, err: str, *needles: str) -> None:
    assert status == 2 and stdout == "", (status, stdout, err)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err


NON_FINITE = [
    ("train.learning_rate", "nan"),
    ("train.learning_rate", "inf"),
    ("train.weight_decay", "nan"),
    ("train.grad_clip_norm", "inf"),
    ("train.end_learning_rate_factor", "nan"),
    ("train.b2", "nan"),
    ("model.dropout", "nan"),
    ("model.attention_options.delta", "nan"),
]


@pytest.mark.parametrize("field, value", NON_FINITE, ids=[f"{f}={v}" for f, v in NON_FINITE])
def test_non_finite_float_fields_are_refused_once_before_anything(field, value, tmp_path):
    out = tmp_path / "run"
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke", f"--config.{field}={value}", f"--output_dir={out}"
    )
    assert_one_line(status, stdout, err, f"config.{field}=", "must be a finite number")
    assert err.count(field) == 1, err  # not again by the field's range check
    assert not out.exists()


def test_a_step_count_beyond_int32_is_refused(tmp_path):
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke", "--config.train.num_steps=1000000000000"
    )
    assert_one_line(status, stdout, err, "config.train.num_steps=1000000000000 exceeds 2147483647")


def test_a_batch_too_big_for_the_host_is_refused_before_any_batch_is_built(monkeypatch):
    # The step estimate builds one host batch: a batch the host cannot hold (here a host
    # of 1 MiB) is refused before it is built.
    monkeypatch.setattr(step_size, "step_estimate", lambda config: pytest.fail("batch was built"))
    monkeypatch.setattr(step_size, "host_memory", lambda: 2.0**20)
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke", "--config.train.batch_size=100000", "--dry_run"
    )
    assert_one_line(status, stdout, err, "config.train.batch_size=100000 with config.task.seq_len=")
    assert "ids and mask), more than this host's 0.000977 GiB; lower the batch" in err


def test_adam_epsilon_must_be_positive(tmp_path):
    lra = os.path.join(ROOT, "configs", "lra", "listops.py")
    status, stdout, err = run_train(
        f"--config={lra}:sbm,smoke", "--config.train.eps=0.0", f"--output_dir={tmp_path / 'r'}"
    )
    assert_one_line(status, stdout, err, "config.train.eps=0.0 must be a positive number")


@pytest.mark.parametrize("field", ["num_heads", "head_dim", "emb_dim"])
def test_a_zero_size_is_one_message_not_the_same_check_twice(field, tmp_path):
    status, stdout, err = run_train(f"--config={SYNTHETIC}:sbm,smoke", f"--config.model.{field}=0")
    assert_one_line(status, stdout, err, f"config.model.{field}=0 must be a positive integer")
    assert err.count(";") == 0, err


def test_print_config_with_a_bad_value_prints_the_error_alone():
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke", "--config.train.batch_size=0", "--print_config"
    )
    assert_one_line(status, stdout, err, "config.train.batch_size=0 must be a positive integer")


def test_workdir_is_output_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(step_size, "step_estimate", lambda config: "not needed here")
    status, stdout, err = run_train(
        f"--config={SYNTHETIC}:sbm,smoke", f"--workdir={tmp_path / 'w'}", "--dry_run"
    )
    assert status == 0, err
    assert f"would train a new run in {tmp_path / 'w'}" in stdout
    status, _, err = run_train(f"--config={SYNTHETIC}:sbm,smoke", "--help")
    assert status == 0


def test_list_presets_names_every_part_a_config_accepts():
    status, stdout, err = run_train(f"--config={SYNTHETIC}", "--list_presets")
    assert status == 0, err
    assert "mechanisms: sbm, sbm_poisson, sbm_pairs, full" in stdout
    assert "scales:     paper, quick, smoke" in stdout
    lra = os.path.join(ROOT, "configs", "lra", "listops.py")
    status, stdout, err = run_train(f"--config={lra}:sbm", "--list_presets")
    assert status == 0 and "lambda=<float>, seed=<int>" in stdout, err
    # every part listed is accepted
    for line in stdout.splitlines():
        if line.strip().startswith("scales:"):
            scales = line.split(":", 1)[1].split("(")[0].replace(" ", "").split(",")
    for scale in scales:
        assert cli.load_config_file(f"{lra}:sbm,{scale}") is not None
    status, stdout, err = run_train("--config=no/such.py", "--list_presets")
    assert_one_line(status, stdout, err, "no such file")


def test_metrics_jsonl_is_strict_json_with_null_for_non_finite(tmp_path):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write({"step": 1, "loss": math.nan, "grad_norm": math.inf, "per_head": [1.0, -math.inf]})
    writer.close()

    def refuse(token: str):
        raise AssertionError(f"non-JSON token {token}")

    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        (record,) = [json.loads(line, parse_constant=refuse) for line in f]
    assert record == {"step": 1, "loss": None, "grad_norm": None, "per_head": [1.0, None]}


def test_a_stopped_run_exits_75_and_a_finished_one_0(tmp_path, monkeypatch):
    from sbm_jax.training import trainer

    stopped = {"stopped_at": 3, "output_dir": str(tmp_path), "reason": "SIGTERM"}
    monkeypatch.setattr(trainer, "train_and_evaluate", lambda *a, **k: stopped)
    status, stdout, err = run_train(f"--config={SYNTHETIC}:sbm,smoke", f"--output_dir={tmp_path}")
    assert status == cli.STOPPED_EXIT == 75, err
    assert stdout.strip().endswith(f"stopped at step 3 (SIGTERM) -> {tmp_path}")


def test_the_lock_file_goes_when_the_run_ends_and_a_late_opener_relocks(tmp_path):
    import fcntl

    lock = RunLock(str(tmp_path))
    path = tmp_path / ".lock"
    assert path.exists()
    late = open(path, "a+")  # a second trainer opened the file before the first ended  # noqa: SIM115
    lock.release()
    assert not path.exists()
    # It gets the flock of the removed file; RunLock would see the path no longer names
    # it. Meanwhile a new RunLock makes and holds a new file.
    fcntl.flock(late.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    again = RunLock(str(tmp_path))
    assert path.exists() and os.stat(path).st_ino != os.fstat(late.fileno()).st_ino
    late.close()
    again.release()
    assert not path.exists()


TINY = (
    f"--config={SYNTHETIC}:full,smoke",
    "--config.task.seq_len=8",
    "--config.train.batch_size=8",
    "--config.train.log_every=1",
    "--config.checkpoint.every_steps=5",
)


def test_a_failed_append_leaves_only_whole_lines(tmp_path, monkeypatch):
    """ENOSPC half-way through a flush: the file is cut back to its last whole line."""
    import errno

    from sbm_jax.training import metrics

    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write({"step": 1, "loss": 0.5})
    writer.flush()
    real_write = os.write

    def half_then_full(fd: int, data) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    writer.write({"step": 2, "loss": 0.25})
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    monkeypatch.setattr(metrics.os, "write", real_write)
    for name in ("metrics.jsonl", "metrics.csv"):
        text = (tmp_path / name).read_text()
        assert text.endswith("\n") and "0.25" not in text, (name, text)
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1]


def test_a_full_disk_is_one_line_and_its_own_exit_status(tmp_path, monkeypatch):
    import errno

    from sbm_jax.training import trainer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "train_and_evaluate", full)
    out = tmp_path / "run"
    status, stdout, err = run_train(*TINY, f"--output_dir={out}")
    assert status == cli.NO_SPACE_EXIT == 74, err
    assert err.count("\n") == 1 and err.startswith("error: no space left on the device"), err
    assert str(out) in err


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 300 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow  # two short trainings per case (~20 s each here)
@pytest.mark.parametrize("estimate", [True, False], ids=["refused-before", "failed-save"])
def test_a_run_on_a_full_disk_leaves_whole_records_and_no_temporary_checkpoint(
    small_tmpfs, estimate, monkeypatch
):
    """The free-space check refuses a checkpoint that cannot fit; without it (a wrong
    estimate) the failed orbax save is cleaned up the same way. Then, with room, the
    same command resumes and finishes."""
    import subprocess

    from sbm_jax.training import checkpoints

    if not estimate:
        monkeypatch.setattr(checkpoints, "_check_space", lambda *a: None)
    out = small_tmpfs / "run"
    args = (*TINY, "--config.train.num_steps=40", f"--output_dir={out}")
    status, stdout, err = run_train(*args)
    assert status == 74, (stdout, err)
    assert err.count("\n") == 1 and "no space left on the device holding" in err, err
    leftovers = [p for p in out.rglob("*") if "orbax-checkpoint-tmp" in p.name]
    assert leftovers == [] and not (out / "summary.json").exists()
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))
    monkeypatch.undo()
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
    status, stdout, err = run_train(*args)
    assert status == 0, err
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert [s for s in steps if s is not None][:40] == list(range(1, 41))


def test_a_signal_during_a_long_step_is_acknowledged_at_once(capfd):
    """The first SIGTERM is acknowledged while the main thread is still inside a long
    XLA computation (where Python's own handler cannot run), not after it."""
    import signal
    import threading
    import time

    import jax
    import jax.numpy as jnp

    from sbm_jax.training.preemption import StopSignals

    @jax.jit
    def slow(x):  # about a second of one XLA call on CPU
        return jax.lax.fori_loop(0, 2000, lambda i, a: jnp.tanh(a @ a), x)

    x = jnp.eye(128) * 0.5
    slow(x).block_until_ready()  # compiled outside the timed part
    with StopSignals() as signals:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        slow(x).block_until_ready()
        done = time.monotonic()
        time.sleep(0.05)  # the Python handler runs now
    assert signals.received == "SIGTERM"
    assert signals.heard_at is not None and signals.heard_at < done, (start, done)
    err = capfd.readouterr().err
    assert "heard SIGTERM: stopping after the step in progress, then saving" in err


def test_dry_run_prints_the_compiled_steps_estimate_and_a_step_too_big_is_refused(
    tmp_path, monkeypatch
):
    seen = []
    real = step_size.step_estimate
    monkeypatch.setattr(
        step_size, "step_estimate", lambda config: seen.append(real(config)) or seen[-1]
    )
    status, stdout, err = run_train(*TINY, "--dry_run")
    assert status == 0, err
    (line,) = [x for x in stdout.splitlines() if x.startswith("compiled train step: ")]
    assert "GiB per device" in line and "GFLOPs per step" in line and "query-key pairs" in line
    # A device smaller than the step: refused, naming the length field, before any work
    # (the estimate above, on a device of 1 KiB).
    (measured,) = seen
    assert measured["memory_bytes"] > 1024 and measured["flops"] > 0
    monkeypatch.setattr(
        step_size, "step_estimate", lambda config: {**measured, "device_bytes": 1024}
    )
    status, stdout, err = run_train(*TINY, "--dry_run")
    assert_one_line(status, stdout, err, "config.task.seq_len=8 with config.train.batch_size=8")
    assert "per device (XLA's estimate of the compiled step), more than the" in err
    # A run (not only --dry_run) whose step is large is checked the same way.
    monkeypatch.setattr(step_size, "LARGE_STEP_PAIRS", 0)
    out = tmp_path / "run"
    status, stdout, err = run_train(*TINY, f"--output_dir={out}")
    assert_one_line(status, stdout, err, "one training step needs about")
    assert not out.exists()
