"""End-to-end smoke test of scripts/compare_synthetic.py at tiny size."""

from __future__ import annotations

import json
import os

import pytest

from configs import synthetic
from tests.scripts_testing import load_script


@pytest.mark.slow  # suite time (15 min): an analysis script's whole run
def test_compare_synthetic_main_writes_table_json_and_plot(tmp_path):
    script = load_script("compare_synthetic")
    out = tmp_path / "cmp"
    results = script.main(
        [
            "--steps=3",
            "--seq_len=8",
            "--batch_size=4",
            "--mechanisms=full,linear",
            "--flops_seq_lens=16,32",
            f"--output_dir={out}",
        ]
    )
    assert [r["mechanism"] for r in results["runs"]] == ["full", "linear"]
    for run in results["runs"]:
        assert run["step"] == 3 and run["loss"] > 0 and 0.0 <= run["accuracy"] <= 1.0
    # full attention reports density 1 (every pair), linear reports none.
    assert results["runs"][0]["density"] == pytest.approx(1.0)
    text = (out / "results.md").read_text()
    assert "| full |" in text and "| linear |" in text and "GFLOPs n=32" in text
    assert os.path.getsize(out / "comparison.png") > 0
    saved = json.loads((out / "results.json").read_text())
    assert {r["seq_len"] for r in saved["flops"]} == {16, 32}


@pytest.mark.slow  # suite time: two tiny comparisons into one folder
def test_a_rerun_with_fewer_mechanisms_keeps_the_others_rows(tmp_path):
    """A rerun with a subset of --mechanisms used to replace results.md / results.json
    with that subset alone, and a resumed run's time column showed only the resume."""
    script = load_script("compare_synthetic")
    out = tmp_path / "cmp"
    common = ["--steps=3", "--seq_len=8", "--batch_size=4", "--flops_seq_lens=16"]
    first = script.main([*common, "--mechanisms=full,linear", f"--output_dir={out}"])
    times = {r["mechanism"]: r["wall_time_s"] for r in first["runs"]}
    again = script.main([*common, "--mechanisms=linear", f"--output_dir={out}"])
    assert [r["mechanism"] for r in again["runs"]] == ["full", "linear"]
    saved = json.loads((out / "results.json").read_text())
    assert [r["mechanism"] for r in saved["runs"]] == ["full", "linear"]
    assert "| full |" in (out / "results.md").read_text()
    linear = next(r for r in again["runs"] if r["mechanism"] == "linear")
    # The time column counts both sessions: at least the training time the checkpoint
    # that was resumed had recorded (the first session's test evaluation came after it).
    from sbm_jax.training.checkpoints import read_checkpoint_meta

    trained = read_checkpoint_meta(str(out / "linear" / "checkpoints" / "latest" / "3"))
    assert linear["resumed_from"] == 3
    assert linear["wall_time_s"] > trained["wall_time_s"] > 0 and times["linear"] > 0
    with pytest.raises(SystemExit) as exit_info:  # other settings: another folder
        script.main(["--steps=3", "--seq_len=16", "--batch_size=4", f"--output_dir={out}"])
    assert exit_info.value.code == 2


def test_a_stopped_run_stops_the_comparison_in_one_line(tmp_path, monkeypatch, capsys):
    """SIGTERM / Ctrl-C during a run: the trainer saves and returns a "stopped" record,
    on which the script used to fail with KeyError: 'loss' and write nothing."""
    script = load_script("compare_synthetic")
    monkeypatch.setattr(
        script, "train_and_evaluate", lambda *a, **k: {"stopped_at": 2, "reason": "SIGTERM"}
    )
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--steps=3", "--seq_len=8", "--mechanisms=full", f"--output_dir={tmp_path}"])
    assert exit_info.value.code == 128 + 15
    assert "stopped at step 2 of full (SIGTERM); the same command resumes it" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "flag, message",
    [("--flops_seq_lens=abc", "comma-separated integers"), ("--flops_seq_lens=0", ">= 1")],
)
def test_bad_flops_lengths_are_refused_before_training(tmp_path, capsys, flag, message):
    script = load_script("compare_synthetic")
    with pytest.raises(SystemExit) as exit_info:
        script.main([flag, "--mechanisms=full", f"--output_dir={tmp_path}"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing trained


def test_compare_synthetic_rejects_unknown_mechanism(tmp_path):
    script = load_script("compare_synthetic")
    with pytest.raises(SystemExit):
        script.main(["--mechanisms=full,nope", f"--output_dir={tmp_path}"])


def test_budget_options_shrink_with_length():
    assert synthetic.mechanism_options("linformer", 64) == {"proj_len": 16, "max_len": 64}
    assert synthetic.mechanism_options("performer", 64, scale_budgets=False) == {}
    sbm = synthetic.mechanism_options("sbm", 64)
    assert sbm["dense_below"] == 64 * 64 and sbm["num_clusters"] == 128


def test_every_mechanism_builds_from_independent_projections():
    # The comparison's table is documented as measured with independent init; the full
    # preset it starts from ties the key projection to the query, which mechanisms
    # without both projections (reformer's shared QK, tsa) cannot do at all.
    import jax

    from sbm_jax.attention import available
    from sbm_jax.models.build import build_model
    from sbm_jax.tasks.registry import build_task
    from sbm_jax.training.state import create_train_state

    script = load_script("compare_synthetic")
    for name in available():
        config = script.make_config(
            name, steps=2, seq_len=8, batch_size=2, seed=0, scale_budgets=True
        )
        assert config.model.query_key_init == "independent", name
        task = build_task(config)
        model = build_model(config.model, task.head)
        state = create_train_state(config, model, task, next(task.train_batches(0)))
        assert jax.tree.leaves(state.params), name


def test_every_mechanism_is_a_synthetic_preset():
    """``configs/synthetic.py:<mechanism>,quick`` for every registered mechanism: its
    defaults with the budget scaled to the length (as the comparison trains it),
    independent init, and a config that passes the trainer's start-up check."""
    from sbm_jax.attention import available
    from sbm_jax.training import validate_config

    assert set(available()) <= set(synthetic.mechanisms())
    for name in available():
        if name in synthetic.MECHANISMS:
            continue
        config = synthetic.get_config(f"{name},quick")
        assert config.model.attention == name and config.name == f"synthetic_{name}_quick"
        assert config.model.query_key_init == "independent", name
        assert config.model.attention_options.to_dict() == synthetic.mechanism_options(name, 64)
        validate_config(config)
    assert synthetic.get_config("performer,quick").model.attention_options.num_features == 16
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        synthetic.get_config("nope,quick")
