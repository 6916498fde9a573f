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
