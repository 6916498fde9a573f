"""The full trainer in a multi-process job: each process feeds only its rows of every
global batch, the losses equal those of one process with as many devices, and only
process 0 writes the metrics, config and summary files."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from lra.input_pipeline import batch_examples, train_examples
from lra.train_task import MockSource, train_rows
from sbm_jax.training.host_data import process_train_rows
from sbm_jax.training.sharding import make_mesh
from tests.process_testing import free_port, run_and_collect, xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "resilience_task.py")


def test_lra_reads_any_rows_of_a_step_by_random_access():
    source = MockSource("listops", "train", 40, 32, 0)
    examples = train_examples(source, task="listops", max_length=32, seed=0)
    batches = batch_examples(examples, 8)
    for step in (0, 4, 9):  # 9 * 8 > 40: the second epoch's reshuffle
        rows = np.array([2, 3, 6, 7])  # process 1 of 2 with 2 micro-batches of 4
        part = train_rows(examples, 8, step, rows)
        whole = dict(batches[step])
        whole["weights"] = whole["example_mask"].astype(np.float32)  # as the task adds
        assert sorted(part) == sorted(whole)
        for key in whole:
            np.testing.assert_array_equal(part[key], whole[key][rows])
            assert part[key].dtype == whole[key].dtype
    with pytest.raises(ValueError, match=r"rows must be indices in \[0, train.batch_size=8\)"):
        train_rows(examples, 8, 0, np.array([8]))


def test_one_process_feeds_every_row_in_order():
    np.testing.assert_array_equal(process_train_rows(12, 3, make_mesh(1)), np.arange(12))


def _run(output_dir, nproc: int, devices: int, *flags: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env["XLA_FLAGS"] = xla_flags(devices)
    for key in ("SBM_COORDINATOR", "SBM_NUM_PROCESSES", "SBM_PROCESS_ID"):
        env.pop(key, None)
    extra = []
    if nproc > 1:
        extra = [f"--coordinator=127.0.0.1:{free_port()}", f"--num_processes={nproc}"]
    commands = [
        [sys.executable, SCRIPT, str(output_dir), *flags, *extra]
        + ([f"--process_id={i}"] if nproc > 1 else [])
        for i in range(nproc)
    ]
    return run_and_collect(commands, env, timeout=300)


def _records(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_two_devices(tmp_path):
    # batch 8 over 2 devices, at most 2 per device per pass: 2 micro-batches of 4, so each
    # process feeds rows {0, 1, 4, 5} or {2, 3, 6, 7} (the interleaved layout).
    flags = ("--steps=4", "--attention=sbm", "--max_per_device_batch=2")
    two = _run(tmp_path / "two", 2, 1, *flags)
    one = _run(tmp_path / "one", 1, 2, *flags)

    assert [(r["process_index"], r["process_count"]) for r in two] == [(0, 2), (1, 2)]
    assert all(r["devices"] == 2 and r["steps"] == 4 for r in two + one)
    a, b = _records(tmp_path / "two"), _records(tmp_path / "one")
    # Only process 0 wrote: one record per step (two writers would duplicate them).
    assert [r["step"] for r in a if r["split"] == "train"] == [1, 2, 3, 4]
    assert [(r["split"], r["step"]) for r in a] == [(r["split"], r["step"]) for r in b]
    with open(tmp_path / "two" / "summary.json", encoding="utf-8") as f:
        assert json.load(f)["processes"] == 2
    with open(tmp_path / "two" / "metrics.csv", encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 1 + 4  # header + one row per step
    for key in ("loss", "grad_norm", "density"):
        np.testing.assert_allclose(
            [r[key] for r in a if r["split"] == "train"],
            [r[key] for r in b if r["split"] == "train"],
            rtol=1e-6,
            atol=1e-7,
            err_msg=key,
        )
    test_a = [r for r in a if r["split"] == "test"][0]
    test_b = [r for r in b if r["split"] == "test"][0]
    np.testing.assert_allclose(test_a["loss"], test_b["loss"], rtol=1e-6)
