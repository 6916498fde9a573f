"""The synthetic repeated-token task: labels, determinism, and the smoke preset end to end."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from configs import synthetic as synthetic_config
from sbm_jax.tasks import build_task
from sbm_jax.tasks.synthetic import (
    accuracy_ceiling,
    batch_for_step,
    duplicate_labels,
    sample_batch,
)
from tests.scripts_testing import ROOT, load_script


def naive_duplicate_labels(tokens: np.ndarray) -> np.ndarray:
    """O(N^2) reference: compare every token with every other one."""
    batch, n = tokens.shape
    labels = np.zeros((batch, n), np.int32)
    for b in range(batch):
        for i in range(n):
            for j in range(n):
                if i != j and tokens[b, i] == tokens[b, j]:
                    labels[b, i] = 1
                    break
    return labels


def test_labels_match_naive_quadratic_check():
    rng = np.random.default_rng(0)
    for n in (1, 2, 8, 33):
        tokens = rng.integers(1, n + 1, size=(5, n))
        np.testing.assert_array_equal(duplicate_labels(tokens), naive_duplicate_labels(tokens))
    # The paper's example.
    example = np.array([[1, 4, 3, 7, 3, 2, 3, 1]])
    np.testing.assert_array_equal(duplicate_labels(example), [[1, 0, 1, 0, 1, 0, 1, 1]])


def test_batches_have_the_paper_distribution_and_are_deterministic():
    batch = sample_batch(np.random.default_rng(1), 64, 256)
    assert batch["inputs"].shape == (64, 256)
    assert batch["inputs"].min() >= 1 and batch["inputs"].max() <= 256
    assert batch["mask"].all() and batch["weights"].sum() == 64 * 256
    # P(repeated) = 1 - (1 - 1/N)^(N-1); with 16k tokens the mean is within 0.02.
    expected = 1 - (1 - 1 / 256) ** 255
    assert abs(batch["targets"].mean() - expected) < 0.02
    a, b = batch_for_step(3, 7, 4, 16), batch_for_step(3, 7, 4, 16)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], batch_for_step(3, 8, 4, 16)["inputs"])
    assert not np.array_equal(a["inputs"], batch_for_step(3, 7, 4, 16, stream=1)["inputs"])


def test_task_iterator_restarts_at_a_step():
    config = synthetic_config.get_config("full,smoke")
    task = build_task(config)
    from_zero = task.train_batches(0)
    batches = [next(from_zero) for _ in range(3)]
    np.testing.assert_array_equal(next(task.train_batches(2))["inputs"], batches[2]["inputs"])


def test_task_config_errors_name_the_field():
    config = synthetic_config.get_config("full,smoke")
    config.model.vocab_size = 5
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_task(config)
    config = synthetic_config.get_config("full,smoke")
    config.task.name = "nope"
    with pytest.raises(ValueError, match="task.name='nope'"):
        build_task(config)


def _train_module():
    return load_script("train")


def _train_through_the_entry_point(preset: str, output_dir: str) -> dict:
    """``scripts/train.py --config=configs/synthetic.py:<preset> --output_dir=...`` in
    this process (its ``main``, exit status 0), and the run's summary.json."""
    status = _train_module().main(
        [
            "train.py",
            f"--config={os.path.join(ROOT, 'configs', 'synthetic.py')}:{preset}",
            f"--output_dir={output_dir}",
        ]
    )
    assert status == 0
    with open(os.path.join(output_dir, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def _check_run(summary: dict, output_dir: str) -> list[dict]:
    for name in ("metrics.jsonl", "metrics.csv", "metrics.png", "summary.json", "config.json"):
        assert os.path.getsize(os.path.join(output_dir, name)) > 0, name
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, summary["step"] + 1))
    with open(os.path.join(output_dir, "metrics.csv")) as f:
        lines = f.read().splitlines()
    assert lines[0] == "step,loss,accuracy,density" and len(lines) == summary["step"] + 1
    return train


def test_smoke_preset_trains_through_the_entry_point(tmp_path):
    summary = _train_through_the_entry_point("full,smoke", str(tmp_path / "full"))
    assert summary["step"] == synthetic_config.get_config("full,smoke").train.num_steps
    train = _check_run(summary, str(tmp_path / "full"))
    first = np.mean([r["loss"] for r in train[:5]])
    last = np.mean([r["loss"] for r in train[-5:]])
    assert last < first - 0.1, (first, last)
    assert all(r["density"] == 1.0 for r in train)


@pytest.mark.parametrize(
    "mechanism",
    ["sbm", pytest.param("sbm_pairs", marks=pytest.mark.slow)],  # suite time (15 min)
)
def test_smoke_preset_with_sbm_logs_density(tmp_path, mechanism):
    from sbm_jax.attention import available

    if "sbm" not in available():
        pytest.skip("sbm attention not registered")
    summary = _train_through_the_entry_point(f"{mechanism},smoke", str(tmp_path / "sbm"))
    assert summary["config"]["model"]["attention_options"]["ste"] == (
        "pairs" if mechanism == "sbm_pairs" else "paper"
    )
    train = _check_run(summary, str(tmp_path / "sbm"))
    densities = [r["density"] for r in train]
    assert all(0.0 < d <= 1.0 for d in densities)
    assert len(set(densities)) > 1  # sampled graphs differ from step to step
    assert "encoder/block_0/attention" in train[-1]["density_per_head"]
    first = np.mean([r["loss"] for r in train[:5]])
    last = np.mean([r["loss"] for r in train[-5:]])
    assert last < first - 0.1, (first, last)


@pytest.mark.parametrize("density", [0.2, 0.5, 0.9])
def test_accuracy_ceiling_matches_a_simulated_bayes_optimal_reader(density):
    # Simulate sequences and a random graph at the given density (self pair excluded);
    # the best rule that only knows "a match was seen" or not is read off the simulated
    # counts (majority label in each of the two observable states), not from the formula.
    rng = np.random.default_rng(0)
    n, batch = 32, 4000
    tokens = rng.integers(1, n + 1, size=(batch, n))
    labels = duplicate_labels(tokens)
    same = tokens[:, :, None] == tokens[:, None, :]
    seen = rng.random((batch, n, n)) < density
    off_diagonal = ~np.eye(n, dtype=bool)[None]
    match_seen = np.any(same & seen & off_diagonal, axis=-1)
    correct = 0
    for state in (False, True):
        in_state = match_seen == state
        ones = int(np.sum(labels[in_state]))
        correct += max(ones, int(np.sum(in_state)) - ones)
    simulated = correct / labels.size
    stderr = math.sqrt(simulated * (1 - simulated) / labels.size)
    assert abs(accuracy_ceiling(n, density) - simulated) < 5 * stderr + 1e-3


def test_accuracy_ceiling_end_points_and_flat_start():
    for n in (16, 64, 256):
        baseline = 1 - (1 - 1 / n) ** (n - 1)  # the all-ones guess
        assert accuracy_ceiling(n, 0.0) == pytest.approx(baseline, abs=1e-12)
        assert accuracy_ceiling(n, 1.0) == pytest.approx(1.0, abs=1e-12)
        # no density below ~0.3 can beat the all-ones guess; 99% needs ~0.98
        assert accuracy_ceiling(n, 0.29) == pytest.approx(baseline, abs=1e-12)
        assert accuracy_ceiling(n, 0.9) < 0.97 < 0.99 < accuracy_ceiling(n, 0.985)
    with pytest.raises(ValueError, match="density"):
        accuracy_ceiling(64, 1.5)


def test_synthetic_table_reads_the_steps_a_run_leaves_the_baseline_and_solves(tmp_path):
    table = load_script("synthetic_table")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps({"seed": 3, "model": {"attention": "sbm", "attention_options": {}}})
    )
    # accuracy 0.63 for steps 1-50, 0.8 for 51-100, 1.0 from 101; density 0.2 then 0.9
    rows = ["step,loss,accuracy,density"]
    for step in range(1, 151):
        acc = 0.63 if step <= 50 else (0.8 if step <= 100 else 1.0)
        rows.append(f"{step},0.5,{acc},{0.2 if step <= 50 else 0.9}")
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    row = table.run_row(str(run), leave=0.7, solved=0.99, smooth=10)
    # a 10-step trailing mean first reaches 0.70 when 5 of its 10 values are 0.8
    # (0.5 * 0.63 + 0.5 * 0.8 = 0.715; 4 of 10 give 0.698), i.e. at step 55
    assert row["leaves_baseline"] == 55
    assert row["solved"] == 110  # all ten values 1.0
    assert row["finished"] is False and row["last_step"] == 150
    assert row["ste"] == "paper" and row["seed"] == 3
    assert row["max_density"] == pytest.approx(0.9)
    assert "stopped at 150" in table.markdown([row])


def test_synthetic_test_split_is_not_the_dev_split():
    # the best checkpoint is chosen on dev: reporting it on the same batches would be
    # biased upward, so the test batches come from their own stream
    config = synthetic_config.get_config("full,smoke")
    config.task.eval_batches = 2
    task = build_task(config)
    dev = list(task.eval_batches())
    (test_fn,) = task.test_splits.values()
    test = list(test_fn())
    assert len(dev) == len(test) == 2
    for d, t in zip(dev, test, strict=True):
        assert d["inputs"].shape == t["inputs"].shape
        assert not np.array_equal(d["inputs"], t["inputs"])
    # the same batches on every call (a resumed run tests on the same data)
    assert all(
        np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(test, test_fn(), strict=True)
    )
