"""Fine-tuning task construction (no training): which tokenizer it accepts and which
examples its predictions cover, on ``tfds.testing.mock_data``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
import tensorflow_datasets.text  # noqa: F401  (registers the glue builder without TF)

from glue import tasks  # noqa: F401  (registers the glue_* tasks)
from glue.corpus import read_local_corpus
from glue.tokenizer import save_tokenizer, train_tokenizer
from sbm_jax.tasks import build_task
from tests.glue.conftest import load_config

MOCK_EXAMPLES = 7
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, corpus_glob) -> str:
    tokenizer = train_tokenizer(read_local_corpus(corpus_glob), 300)
    return save_tokenizer(tokenizer, str(tmp_path_factory.mktemp("tokenizer")))


def test_max_eval_examples_does_not_cut_test_predictions(tokenizer_path, tmp_path):
    """``data.max_eval_examples`` caps the validation splits; the unlabelled test splits
    are predicted in full, so the submission files hold a row for every example."""
    config = load_config("finetune", "sbm,smoke,task=mnli")
    config.data.tokenizer = tokenizer_path
    config.data.max_eval_examples = 3
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
        expected = {}  # what TFDS holds, read directly: every test example's idx
        for split in ("test_matched", "test_mismatched"):
            source = tfds.data_source("glue/mnli", split=split)
            expected[split] = sorted(int(source[i]["idx"]) for i in range(len(source)))
        task = build_task(config)
    assert sorted(task.predict_splits) == sorted(expected)
    for split, batches in task.predict_splits.items():
        rows = [b["index"][b["example_mask"]] for b in batches()]
        assert sorted(np.concatenate(rows).tolist()) == expected[split]
        assert len(expected[split]) == MOCK_EXAMPLES
        predicted = np.zeros(MOCK_EXAMPLES, np.int64)
        path = task.write_predictions(split, np.asarray(expected[split]), predicted, str(tmp_path))
        with open(path, encoding="utf-8") as f:
            assert len(f.read().splitlines()) == 1 + MOCK_EXAMPLES  # header + every example
    for split, batches in task.test_splits.items():  # the validation cap still applies
        assert sum(int(b["example_mask"].sum()) for b in batches()) == 3, split
    assert sorted(os.listdir(tmp_path / "predictions")) == ["MNLI-m.tsv", "MNLI-mm.tsv"]


def pretraining_run(run_dir, tokenizer_path: str | None, monkeypatch) -> str:
    """A stand-in pretraining run at ``run_dir`` (its ``tokenizer.json`` copied from
    ``tokenizer_path`` unless None): ``config.init_from`` resolves to its best checkpoint,
    whose metadata holds the smoke SBM encoder config (its vocabulary the tokenizer's
    size). Only the checkpoint lookup is
    replaced; what glue.tasks does with the run directory is the real code."""
    import shutil

    from glue.tokenizer import load_tokenizer

    checkpoint = run_dir / "checkpoints" / "best" / "2"
    checkpoint.mkdir(parents=True)
    model = load_config("finetune", "sbm,smoke,task=sst2").model.to_dict()
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, run_dir / "tokenizer.json")
        model["vocab_size"] = load_tokenizer(tokenizer_path).get_vocab_size()
    monkeypatch.setattr(tasks, "find_checkpoint", lambda path: str(checkpoint))
    monkeypatch.setattr(tasks, "read_checkpoint_meta", lambda path: {"config": {"model": model}})
    return str(run_dir)


def finetune_config(init_from: str, tokenizer: str = ""):
    config = load_config("finetune", "sbm,smoke,task=sst2")
    config.init_from = init_from
    config.data.tokenizer = tokenizer
    return config


def test_finetuning_refuses_a_tokenizer_other_than_the_pretraining_one(
    tokenizer_path, tmp_path, monkeypatch, capsys
):
    """The encoder's embeddings are indexed by the pretraining tokenizer's ids: another
    tokenizer (even a smaller one, which the vocabulary-size check lets through) must be
    refused in one line naming the field and both files; the same tokenizer under another
    path, re-saved, is fine."""
    from glue.tokenizer import load_tokenizer
    from sbm_jax.training.config_checks import ConfigError

    run = pretraining_run(tmp_path / "pre", tokenizer_path, monkeypatch)
    other = train_tokenizer(read_local_corpus(os.path.join(os.path.dirname(__file__), "*.py")), 280)
    other_path = save_tokenizer(other, str(tmp_path / "other"))
    assert other.get_vocab_size() <= load_tokenizer(tokenizer_path).get_vocab_size()
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
        with pytest.raises(ConfigError) as err:
            build_task(finetune_config(run, other_path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"config.data.tokenizer={other_path!r} ")
    assert repr(os.path.join(run, "tokenizer.json")) in message

    copy_path = save_tokenizer(load_tokenizer(tokenizer_path), str(tmp_path / "copy"))
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
        assert build_task(finetune_config(run, copy_path)).name == "glue_sst2"
        assert build_task(finetune_config(run)).name == "glue_sst2"  # the run's own
    assert "warning" not in capsys.readouterr().out


def test_finetuning_says_when_the_tokenizer_cannot_be_checked(
    tokenizer_path, tmp_path, monkeypatch, capsys
):
    """A checkpoint copied without its run's tokenizer.json: data.tokenizer is the only
    way to fine-tune it, so it is used, with a warning that nothing checked it."""
    run = pretraining_run(tmp_path / "pre", None, monkeypatch)
    config = finetune_config(run, tokenizer_path)
    with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
        assert build_task(config).name == "glue_sst2"
    out = capsys.readouterr().out
    assert "warning: config.data.tokenizer=" in out and "is not checked" in out


def test_dry_run_catches_a_preset_of_another_mechanism(tokenizer_path, tmp_path, monkeypatch):
    """--dry_run is how a cloud user checks a config before a VM starts; the fine-tuning
    preset's mechanism against the pretraining checkpoint's was only checked when the
    task was built, after the dry run had said "config OK"."""
    import io

    from sbm_jax.training import cli
    from scripts import train as train_script

    run = pretraining_run(tmp_path / "pre", tokenizer_path, monkeypatch)  # an SBM encoder

    def dry_run(preset: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        status = cli.main(
            [
                "train.py",
                f"--config={os.path.join(ROOT, 'configs', 'glue', 'finetune.py')}:{preset}",
                f"--config.init_from={run}",
                f"--output_dir={tmp_path / 'tuned'}",
                "--dry_run",
            ],
            task_modules=train_script.TASK_MODULES,
            stdout=out,
            stderr=err,
        )
        return status, out.getvalue(), err.getvalue()

    status, out, err = dry_run("full,smoke,task=sst2")
    assert status == 2 and "Traceback" not in err, err
    assert "config.model.attention='full' but the checkpoint was pretrained with 'sbm'" in err
    status, out, err = dry_run("sbm,smoke,task=sst2")
    assert status == 0 and "config OK" in out, err
    # sbm and sbm_nowindow are one registry name; the window tells them apart, and a
    # no-window preset on a windowed checkpoint trained with the window but was
    # labelled "SBM-Transformer (no window)" in Table 4.
    status, out, err = dry_run("sbm_nowindow,smoke,task=sst2")
    assert status == 2 and "Traceback" not in err, err
    assert "config.model.attention_options.window=0 (preset 'sbm_nowindow')" in err, err
