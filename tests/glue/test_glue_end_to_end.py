"""Offline end to end through ``scripts/train.py``: tokenizer on the project's docs, a
few MLM steps with SBM + window, then a few fine-tuning steps from that run
(``--config.init_from``) for every GLUE task on ``tfds.testing.mock_data``: summaries,
best/latest fine-tuned checkpoints, dev metrics in TensorBoard, test predictions in the
GLUE submission format, and the Table 4 report."""

from __future__ import annotations

import glob
import io
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
import tensorflow_datasets.text  # noqa: F401  (registers the glue builder without TF)
from jax.experimental.compilation_cache import compilation_cache

from glue.data import GLUE_TASKS
from glue.tokenizer import load_tokenizer
from sbm_jax.training import cli
from scripts import train as train_script
from tests.glue.conftest import ROOT

MOCK_EXAMPLES = 9  # not a multiple of the eval batch: the padded last batch is exercised
PRETRAIN = os.path.join(ROOT, "configs", "glue", "pretrain.py")
FINETUNE = os.path.join(ROOT, "configs", "glue", "finetune.py")


def run_train(*args: str) -> tuple[int, str, str]:
    """``scripts/train.py`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = cli.main(
        ["train.py", *args], task_modules=train_script.TASK_MODULES, stdout=out, stderr=err
    )
    return status, out.getvalue(), err.getvalue()


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


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus_glob) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("pretrain"))
    status, stdout, stderr = run_train(
        f"--config={PRETRAIN}:sbm,smoke",
        "--config.model.num_layers=1",
        "--config.train.num_steps=2",
        f"--config.data.corpus={corpus_glob}",
        f"--output_dir={out}",
    )
    assert status == 0, stderr[-3000:]
    assert "glue_mlm (sbm, seed 0)" in stdout
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        return out, json.load(f)


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_pretraining_outputs(pretrained):
    out, summary = pretrained
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert os.path.isdir(os.path.join(out, "checkpoints", "latest", "2"))
    assert os.path.isdir(os.path.join(out, "checkpoints", "best", "2"))
    tokenizer = load_tokenizer(os.path.join(out, "tokenizer.json"))
    assert summary["vocab_size"] == tokenizer.get_vocab_size() <= 300
    # What was trained: the tokenizer's vocabulary, not the preset's 300.
    assert summary["config"]["model"]["vocab_size"] == tokenizer.get_vocab_size()
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
    pre, _ = pretrained
    summaries = {}
    for task in ("sst2", "qqp", "mnli", "qnli"):
        target = str(tmp_path_factory.mktemp(f"ft_{task}"))
        with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
            status, _, stderr = run_train(
                f"--config={FINETUNE}:sbm,smoke,task={task}",
                f"--config.init_from={pre}",
                "--config.train.num_steps=2",
                f"--output_dir={target}",
            )
        assert status == 0, stderr[-3000:]
        with open(os.path.join(target, "summary.json"), encoding="utf-8") as f:
            summaries[task] = json.load(f)
    return summaries


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_finetuning_summaries(finetuned, pretrained):
    pre, _ = pretrained
    for task, summary in finetuned.items():
        expected = (
            ["validation_matched", "validation_mismatched"] if task == "mnli" else ["validation"]
        )
        assert sorted(summary["test_splits"]) == expected
        for metrics in summary["test_splits"].values():
            assert metrics["num_examples"] == MOCK_EXAMPLES
            for key in ("accuracy", "f1", "macro_f1", "density"):
                assert 0.0 <= metrics[key] <= 1.0
        key = "macro_f1" if task == "mnli" else "f1"
        assert summary["metric"] == key and summary["glue_task"] == task
        mean = np.mean([m[key] for m in summary["test_splits"].values()])
        assert summary["headline"] == pytest.approx(mean)
        accuracy = np.mean([m["accuracy"] for m in summary["test_splits"].values()])
        assert summary["headline_accuracy"] == pytest.approx(accuracy)
        assert math.isfinite(summary["loss"])
        # Initialised from the pretraining run's best checkpoint, its encoder config kept.
        assert summary["init_from"] == os.path.join(pre, "checkpoints", "best", "2")
        assert summary["config"]["model"]["num_layers"] == 1
        out = summary["output_dir"]
        assert os.path.isdir(os.path.join(out, "checkpoints", "best", "2"))
        assert os.path.isdir(os.path.join(out, "checkpoints", "latest", "2"))
        assert os.path.isfile(os.path.join(out, "tokenizer.json"))


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_dev_metrics_reach_tensorboard(finetuned):
    from tests.test_metrics_tensorboard import read_scalars

    for summary in finetuned.values():
        scalars, _ = read_scalars(os.path.join(summary["output_dir"], "tensorboard"))
        for tag in ("dev/accuracy", "dev/f1", "dev/macro_f1", "train/loss"):
            assert (tag, 2) in scalars, (tag, sorted(scalars)[:8])


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_test_predictions_in_glue_submission_format(finetuned):
    expected_files = {
        "sst2": ["SST-2.tsv"],
        "qqp": ["QQP.tsv"],
        "mnli": ["MNLI-m.tsv", "MNLI-mm.tsv"],
        "qnli": ["QNLI.tsv"],
    }
    for task, summary in finetuned.items():
        directory = os.path.join(summary["output_dir"], "predictions")
        assert sorted(os.listdir(directory)) == expected_files[task]
        spec = GLUE_TASKS[task]
        allowed = set(spec.label_names or [str(i) for i in range(spec.num_classes)])
        for name in expected_files[task]:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                lines = f.read().splitlines()
            assert lines[0] == "index\tprediction"
            rows = [line.split("\t") for line in lines[1:]]
            assert len(rows) == MOCK_EXAMPLES
            assert all(label in allowed for _, label in rows)
            indices = [int(i) for i, _ in rows]
            assert indices == sorted(indices)


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_finetuning_feeds_each_process_only_its_rows(pretrained):
    """What one process of a multi-process job reads: exactly its rows of each batch,
    the same as cut from the whole batch (data read from the mock GLUE)."""
    from sbm_jax.tasks import build_task

    pre, _ = pretrained
    config = cli.load_config_file(f"{FINETUNE}:sbm,smoke,task=qqp")
    config.init_from = pre
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
        task = build_task(config)
    assert task.process_train_batches is not None
    rows = np.array([1, 3])
    whole, part = task.train_batches(5), task.process_train_batches(5, rows)
    for _ in range(3):  # crosses an epoch boundary: 9 examples, batches of 4
        full, own = next(whole), next(part)
        assert sorted(own) == sorted(full)
        for key, value in own.items():
            np.testing.assert_array_equal(value, full[key][rows])


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
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
    # Accuracy beside the paper's F1: a second table, our accuracy per cell.
    accuracy = table[table.index("Accuracy") :].splitlines()
    row = next(line for line in accuracy if line.startswith("| SBM-Transformer (+ window 64) |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    for cell, task in zip(cells, ("sst2", "qqp", "mnli", "qnli"), strict=True):
        assert cell == f"{100 * finetuned[task]['headline_accuracy']:.1f}"
    assert capsys.readouterr().out == table


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_missing_tokenizer_names_the_field(pretrained, tmp_path):
    pre, _ = pretrained
    run_copy = tmp_path / "run"
    shutil.copytree(os.path.join(pre, "checkpoints"), run_copy / "checkpoints")
    status, _, stderr = run_train(
        f"--config={FINETUNE}:sbm,smoke,task=sst2",
        f"--config.init_from={run_copy}",
        f"--output_dir={tmp_path / 'ft'}",
    )
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: ") and "config.data.tokenizer" in stderr
    assert not (tmp_path / "ft" / "config.json").exists()


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_other_tokenizer_than_pretraining_is_refused(pretrained, tmp_path):
    """--config.data.tokenizer naming a tokenizer other than the pretraining run's is one
    error line naming the field and both files, before the run directory is made."""
    from glue.corpus import read_local_corpus
    from glue.tokenizer import save_tokenizer, train_tokenizer

    pre, _ = pretrained
    other = save_tokenizer(
        train_tokenizer(read_local_corpus(os.path.join(ROOT, "README.md")), 280),
        str(tmp_path / "other"),
    )
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
        status, _, stderr = run_train(
            f"--config={FINETUNE}:sbm,smoke,task=sst2",
            f"--config.init_from={pre}",
            f"--config.data.tokenizer={other}",
            f"--output_dir={tmp_path / 'ft'}",
        )
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: config.data.tokenizer={other!r} ")
    assert repr(os.path.join(pre, "tokenizer.json")) in stderr
    assert not (tmp_path / "ft" / "config.json").exists()


@pytest.mark.slow  # suite time (15 min): pretraining + fine-tuning runs
def test_mechanism_mismatch_names_the_field(pretrained, tmp_path):
    pre, _ = pretrained
    status, _, stderr = run_train(
        f"--config={FINETUNE}:full,smoke,task=sst2",
        f"--config.init_from={pre}",
        f"--output_dir={tmp_path / 'ft'}",
    )
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert "config.model.attention='full'" in stderr


def test_broken_corpus_names_the_field(tmp_path):
    status, _, stderr = run_train(
        f"--config={PRETRAIN}:full,smoke",
        f"--config.data.corpus={tmp_path / 'missing' / '*.txt'}",
        f"--output_dir={tmp_path / 'out'}",
    )
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert "config.data.corpus=" in stderr and "matches no files" in stderr
    assert not (tmp_path / "out").exists()  # checked before anything is created


def test_aliases_map_their_flags(tmp_path, corpus_glob):
    """``glue.pretrain --corpus`` is ``scripts/train.py --config.data.corpus``."""
    import contextlib

    from glue import pretrain

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = pretrain.main(
            [
                "pretrain",
                f"--config={PRETRAIN}:full,smoke",
                f"--corpus={corpus_glob}",
                "--print_config",
            ]
        )
    assert status == 0, err.getvalue()
    assert f"corpus: {corpus_glob}" in out.getvalue()
    assert not glob.glob(str(tmp_path / "*"))
