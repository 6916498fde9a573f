"""Offline end to end: tokenizer on the project's docs, a few MLM steps with SBM + window,
then a few fine-tuning steps on ``tfds.testing.mock_data`` for every GLUE task, the JSON
summaries and the Table 4 report."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
import tensorflow_datasets.text  # noqa: F401  (registers the glue builder without TF)
from glue.finetune_lib import run_finetuning
from glue.pretrain_lib import run_pretraining
from jax.experimental.compilation_cache import compilation_cache

from glue.tokenizer import load_tokenizer
from tests.glue.conftest import load_config

MOCK_EXAMPLES = 9  # not a multiple of the eval batch: the padded last batch is exercised


@pytest.fixture(scope="module", autouse=True)
def persistent_compilation_cache(tmp_path_factory):
    """A persistent XLA cache for this module only: SST-2, QQP and QNLI fine-tuning
    compile to the same programs, so the second and third reuse the first's."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # later modules see no cache, as before


def _tiny(config) -> None:
    config.model.num_layers = 1
    config.train.num_steps = 2


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus_glob) -> tuple[str, dict]:
    config = load_config("pretrain", "sbm,smoke")
    _tiny(config)
    config.data.corpus = corpus_glob
    out = str(tmp_path_factory.mktemp("pretrain"))
    return out, run_pretraining(config, out)


def test_pretraining_outputs(pretrained):
    out, summary = pretrained
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert os.path.isdir(os.path.join(out, "checkpoints", "2"))
    tokenizer = load_tokenizer(os.path.join(out, "tokenizer.json"))
    assert summary["vocab_size"] == tokenizer.get_vocab_size() <= 300
    # MLM loss at initialisation is near log(vocab) (uniform predictions).
    assert abs(summary["first_mlm_loss"] - math.log(summary["vocab_size"])) < 1.0
    assert math.isfinite(summary["mlm_loss"]) and 0.0 <= summary["mlm_accuracy"] <= 1.0
    per_head = summary["density_per_head"]
    assert list(per_head) == ["encoder/block_0/attention"]
    assert len(per_head["encoder/block_0/attention"]) == 2  # smoke: 2 heads
    assert all(0.0 < d <= 1.0 for d in per_head["encoder/block_0/attention"])
    assert summary["eval"] and math.isfinite(summary["eval"]["loss"])
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory) -> dict[str, dict]:
    out, _ = pretrained
    summaries = {}
    for task in ("sst2", "qqp", "mnli", "qnli"):
        config = load_config("finetune", f"sbm,smoke,task={task}")
        _tiny(config)
        target = str(tmp_path_factory.mktemp(f"ft_{task}"))
        with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
            summaries[task] = run_finetuning(config, out, target)
    return summaries


def test_finetuning_summaries(finetuned):
    for task, summary in finetuned.items():
        expected = (
            ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        )
        assert sorted(summary["splits"]) == expected
        for metrics in summary["splits"].values():
            assert metrics["num_examples"] == MOCK_EXAMPLES
            for key in ("accuracy", "f1", "macro_f1", "density"):
                assert 0.0 <= metrics[key] <= 1.0
        key = "macro_f1" if task == "mnli" else "f1"
        assert summary["metric"] == key
        mean = np.mean([m[key] for m in summary["splits"].values()])
        assert summary["headline"] == pytest.approx(mean)
        assert math.isfinite(summary["train_loss"])
        with open(os.path.join(summary["output_dir"], "summary.json"), encoding="utf-8") as f:
            assert json.load(f)["headline"] == pytest.approx(summary["headline"])


def test_report_renders_table(finetuned, tmp_path, capsys):
    from scripts.glue_report import main

    paths = [os.path.join(s["output_dir"], "summary.json") for s in finetuned.values()]
    output = tmp_path / "table.md"
    assert main([*paths, "--paper", f"--output={output}"]) == 0
    table = output.read_text()
    lines = table.splitlines()
    assert lines[0] == "| Model | SST-2 | QQP | MNLI | QNLI |"
    row = next(line for line in lines if line.startswith("| SBM-Transformer (+ window 64) |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    for cell, task in zip(cells, ("sst2", "qqp", "mnli", "qnli"), strict=True):
        assert cell == f"{100 * finetuned[task]['headline']:.1f}"
    assert "| Full-attention (paper) | 89.8 | 84.7 | 84.0 | 85.0 |" in lines
    assert capsys.readouterr().out == table


def test_missing_tokenizer_names_the_flag(pretrained, tmp_path):
    out, _ = pretrained
    run_copy = tmp_path / "run"
    shutil.copytree(os.path.join(out, "checkpoints"), run_copy / "checkpoints")
    config = load_config("finetune", "sbm,smoke,task=sst2")
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        run_finetuning(config, str(run_copy), str(tmp_path / "ft"))


def test_mechanism_mismatch_names_the_field(pretrained, tmp_path):
    out, _ = pretrained
    config = load_config("finetune", "full,smoke,task=sst2")
    with pytest.raises(ValueError, match="model.attention="):
        run_finetuning(config, out, str(tmp_path / "ft"))


def test_broken_corpus_names_the_flag(tmp_path):
    config = load_config("pretrain", "full,smoke")
    config.data.corpus = str(tmp_path / "missing" / "*.txt")
    with pytest.raises(FileNotFoundError, match="--corpus="):
        run_pretraining(config, str(tmp_path / "out"))
