"""MLM pretraining data (no training): which tokenizer a continued pretraining run uses,
what a TFDS document is, and that a resumed run refuses a corpus that changed."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds
import tokenizers

import glue.tasks  # noqa: F401  (registers glue_mlm)
from glue import mlm
from glue.corpus import read_local_corpus
from glue.tokenizer import (
    TOKENIZER_FILE,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)
from sbm_jax.tasks import build_task
from sbm_jax.training.config_checks import ConfigError
from tests.glue.conftest import ROOT, load_config

DOCS = sorted(os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")))
DOCS = [p for p in DOCS if p.endswith(".md")]


def corpus_dir(path, files) -> str:
    """A corpus folder holding copies of ``files``; returns its glob."""
    path.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(f, path)
    return str(path / "*.md")


def pretrain_config(corpus: str, init_from: str = "", tokenizer: str = ""):
    config = load_config("pretrain", "full,smoke")
    config.data.corpus = corpus
    config.init_from = init_from
    config.data.tokenizer = tokenizer
    return config


def pretraining_run(run_dir, tokenizer_path: str | None) -> str:
    """A stand-in pretraining run: ``checkpoints/best/2/state`` (what find_checkpoint
    looks for) and, unless None, a copy of ``tokenizer_path`` as its tokenizer.json."""
    (run_dir / "checkpoints" / "best" / "2" / "state").mkdir(parents=True)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, run_dir / TOKENIZER_FILE)
    return str(run_dir)


@pytest.fixture(scope="module")
def first_tokenizer(tmp_path_factory) -> str:
    """The tokenizer of the first run: trained on the first half of the docs."""
    tokenizer = train_tokenizer(read_local_corpus(",".join(DOCS[: len(DOCS) // 2])), 300)
    return save_tokenizer(tokenizer, str(tmp_path_factory.mktemp("first")))


def test_continued_pretraining_keeps_the_init_runs_tokenizer(first_tokenizer, tmp_path):
    """Continuing from another run on another corpus: that run's tokenizer (the loaded
    embeddings and MLM head are indexed by its ids), not a new one trained on the corpus."""
    run = pretraining_run(tmp_path / "p1", first_tokenizer)
    corpus = corpus_dir(tmp_path / "c2", DOCS[len(DOCS) // 2 :])
    out = tmp_path / "p2"
    out.mkdir()
    task = build_task(pretrain_config(corpus, init_from=run), str(out))
    task.save_files(str(out))
    continued, first = load_tokenizer(str(out / TOKENIZER_FILE)), load_tokenizer(first_tokenizer)
    assert tokenizer_fingerprint(continued) == tokenizer_fingerprint(first)
    text = "Continued pretraining keeps the ids: stochastic block model attention."
    assert continued.encode(text).ids == first.encode(text).ids
    # The same run's tokenizer given explicitly (a copy) is accepted too.
    copy = save_tokenizer(first, str(tmp_path / "copy"))
    assert build_task(pretrain_config(corpus, init_from=run, tokenizer=copy)).name == "glue_mlm"


def test_continued_pretraining_refuses_another_tokenizer(first_tokenizer, tmp_path):
    run = pretraining_run(tmp_path / "p1", first_tokenizer)
    corpus = corpus_dir(tmp_path / "c2", DOCS[len(DOCS) // 2 :])
    other = save_tokenizer(train_tokenizer(read_local_corpus(corpus), 290), str(tmp_path / "o"))
    with pytest.raises(ConfigError) as err:
        build_task(pretrain_config(corpus, init_from=run, tokenizer=other))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"config.data.tokenizer={other!r} ")
    assert repr(os.path.join(run, TOKENIZER_FILE)) in message


def test_continued_pretraining_from_a_run_without_tokenizer_asks_for_one(tmp_path):
    run = pretraining_run(tmp_path / "p1", None)
    corpus = corpus_dir(tmp_path / "c2", DOCS[:2])
    with pytest.raises(ConfigError) as err:
        build_task(pretrain_config(corpus, init_from=run))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"config.init_from={run!r}")
    assert "config.data.tokenizer" in message


def test_tfds_examples_are_whole_documents(monkeypatch):
    """Each TFDS example is one document, paragraphs and all; data.max_documents counts
    examples."""
    articles = [
        {"text": f"Article {a} para 1.\n\nArticle {a} para 2.\n\nArticle {a} para 3."}
        for a in range(5)
    ]
    monkeypatch.setattr(tfds, "data_source", lambda *args, **kwargs: articles)
    config = load_config("pretrain", "full,smoke")
    config.data.tfds_name = "wikipedia/fake"
    config.data.max_documents = 3
    docs = mlm.load_documents(config)
    whole = "Article {0} para 1. Article {0} para 2. Article {0} para 3."
    assert docs == [whole.format(a) for a in range(3)]
    config.data.max_documents = 0
    assert len(mlm.load_documents(config)) == 5


def resume_setup(tmp_path):
    corpus = corpus_dir(tmp_path / "corpus", DOCS[:3])
    out = tmp_path / "run"
    out.mkdir()
    task = build_task(pretrain_config(corpus), str(out))
    task.save_files(str(out))  # what the trainer does on the first session
    return corpus, out


def test_resume_refuses_a_changed_corpus(tmp_path):
    corpus, out = resume_setup(tmp_path)
    assert build_task(pretrain_config(corpus), str(out)).name == "glue_mlm"  # unchanged: fine
    shutil.copy(DOCS[3], tmp_path / "corpus")  # the corpus grows under the same glob
    with pytest.raises(ConfigError) as err:
        build_task(pretrain_config(corpus), str(out))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"config.data.corpus={corpus!r} changed")
    assert "resuming would train on other data" in message


def test_resume_of_a_run_without_fingerprint_is_accepted_with_a_note(tmp_path, capsys):
    corpus, out = resume_setup(tmp_path)
    os.remove(out / mlm.DATA_FINGERPRINT_FILE)  # a run from before the fingerprint
    shutil.copy(DOCS[3], tmp_path / "corpus")
    capsys.readouterr()
    assert build_task(pretrain_config(corpus), str(out)).name == "glue_mlm"
    assert f"note: {str(out)!r} has no {mlm.DATA_FINGERPRINT_FILE}" in capsys.readouterr().out


def test_data_fingerprint_follows_the_tokens():
    data = mlm.MlmData(
        train=np.arange(12, dtype=np.int32).reshape(3, 4),
        eval=np.zeros((1, 4), np.int32),
        special=None,
        vocab_size=300,
        num_tokens=12,
    )
    before = mlm.data_fingerprint(data)
    data.train[0, 0] = 7
    assert mlm.data_fingerprint(data)["sha256"] != before["sha256"]
    assert before["train_shape"] == [3, 4] and before["eval_shape"] == [1, 4]


def test_resume_refusal_names_a_changed_tokenizers_version(tmp_path):
    # an upgraded tokenizers library may encode the same corpus differently: the refusal
    # must name it, not only the corpus
    corpus, out = resume_setup(tmp_path)
    path = out / mlm.DATA_FINGERPRINT_FILE
    saved = json.loads(path.read_text())
    assert saved["tokenizers_version"] == tokenizers.__version__
    saved["sha256"], saved["tokenizers_version"] = "0" * 64, "0.0.1"
    path.write_text(json.dumps(saved))
    with pytest.raises(ConfigError) as err:
        build_task(pretrain_config(corpus), str(out))
    message = str(err.value)
    assert "\n" not in message
    assert f"the tokenizers library (version 0.0.1 then, {tokenizers.__version__} now)" in message
