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
