"""Corpus reading, packing, pair joining, the tokenizer, batching and clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from glue.corpus import pack_sequences, read_local_corpus, split_documents
from glue.data import EpochStream, join_pair, steps_for_epochs
from glue.tokenizer import (
    MIN_VOCAB_SIZE,
    NUM_SPECIAL,
    SPECIAL_TOKENS,
    SpecialIds,
    encode_texts,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)
from sbm_jax.training.checkpoints import find_checkpoint

SPECIAL = SpecialIds(pad=0, cls=1, sep=2, mask=3, unk=4)


def test_split_documents_on_blank_lines():
    text = "first line\nsecond line\n\n  \nthird doc\r\n\r\nfourth\n\n\n"
    assert split_documents(text) == ["first line second line", "third doc", "fourth"]


def test_pack_sequences_layout():
    docs = [[10, 11, 12], [20, 21], [30]]
    packed = pack_sequences(docs, max_len=4, cls_id=1, sep_id=2, pad_id=0)
    # Stream: 10 11 12 <sep> 20 21 <sep> 30 <sep>, cut into chunks of 3 after <cls>.
    expected = [[1, 10, 11, 12], [1, 2, 20, 21], [1, 2, 30, 2]]
    np.testing.assert_array_equal(packed, expected)
    packed = pack_sequences([[5, 6, 7, 8]], max_len=4, cls_id=1, sep_id=2, pad_id=0)
    np.testing.assert_array_equal(packed, [[1, 5, 6, 7], [1, 8, 2, 0]])


def test_join_pair_truncates_longest_first():
    assert join_pair([5, 6], None, 8, SPECIAL) == [1, 5, 6, 2]
    assert join_pair([5, 6, 7, 8], None, 4, SPECIAL) == [1, 5, 6, 2]
    assert join_pair([5, 6], [7], 8, SPECIAL) == [1, 5, 6, 2, 7, 2]
    # Budget 8 - 3 = 5 for a (6 ids) + b (2 ids): a is cut to 3 first, then alternately.
    assert join_pair([5, 6, 7, 8, 9, 10], [11, 12], 8, SPECIAL) == [1, 5, 6, 7, 2, 11, 12, 2]
    assert join_pair([5, 6, 7], [8, 9, 10], 7, SPECIAL) == [1, 5, 6, 2, 8, 9, 2]


def test_epoch_stream_visits_every_example_once_per_epoch():
    stream = EpochStream(num_examples=10, batch_size=4, seed=3)
    seen = np.concatenate([stream.indices(s) for s in range(5)])  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10))
    assert sorted(seen[10:]) == list(range(10))
    # Restarting at a step gives the same batch.
    np.testing.assert_array_equal(EpochStream(10, 4, 3).indices(3), stream.indices(3))
    assert steps_for_epochs(100, 32, 5) == 16  # ceil(500 / 32)


def test_tokenizer_train_save_load(tmp_path, corpus_glob):
    docs = read_local_corpus(corpus_glob)
    tokenizer = train_tokenizer(docs, 400)
    assert special_ids(tokenizer) == SpecialIds(0, 1, 2, 3, 4)
    assert MIN_VOCAB_SIZE < tokenizer.get_vocab_size() <= 400
    path = save_tokenizer(tokenizer, str(tmp_path))
    loaded = load_tokenizer(path)
    text = "Attention über sparse graphs: 𝛿 = 0.01"
    ids = loaded.encode(text, add_special_tokens=False).ids
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # byte-level: no <unk>
    assert loaded.decode(ids).strip() == text
    assert load_tokenizer(str(tmp_path)).get_vocab_size() == tokenizer.get_vocab_size()


# Text with every special literal, alone, doubled, glued to words and at the ends.
LITERAL_TEXTS = (
    [f"the {t} token, {t}{t} and x{t}y at the end {t}" for t in SPECIAL_TOKENS]
    + [f"{t} first" for t in SPECIAL_TOKENS]
    + ["".join(SPECIAL_TOKENS)]
)
PLAIN_TEXTS = [
    "Attention over sparse graphs samples edges per head.",
    "A < b and c > d, but <p> is markup; pad, mask and sep are words.",
    "Über 𝛿 = 0.01 — naïve text",
]


def test_special_token_literals_are_plain_text(tmp_path, corpus_glob):
    """A sentence quoting ``<pad>`` (``<mask>``, ``<sep>`` ...) must not get the special
    id: ``<pad>`` would be padding inside the sentence, ``<sep>`` a fake boundary."""
    from tokenizers import Tokenizer

    trained = train_tokenizer(read_local_corpus(corpus_glob), 400)
    path = save_tokenizer(trained, str(tmp_path))
    loaded = load_tokenizer(path)
    # Expected ids of plain text: the library as it is, before any GLUE setting (how
    # tokenizers and checkpoints made before this rule encoded it).
    before = [
        e.ids for e in Tokenizer.from_file(path).encode_batch(PLAIN_TEXTS, add_special_tokens=False)
    ]
    # A tokenizer loaded elsewhere matches the literals; encode_texts still must not.
    for tokenizer in (trained, loaded, Tokenizer.from_file(path)):
        for text, ids in zip(LITERAL_TEXTS, encode_texts(tokenizer, LITERAL_TEXTS), strict=True):
            assert min(ids) >= NUM_SPECIAL, (text, ids)
            assert tokenizer.decode(ids).strip() == text  # the literal comes back as text
        assert encode_texts(tokenizer, PLAIN_TEXTS) == before
    # Expected ids of the literals: the same BPE with no special tokens registered at
    # all, so nothing can match them ("<pad>" is spelt as "<", "pad", ">" would be).
    saved = json.loads(Tokenizer.from_file(path).to_str())
    saved["added_tokens"] = []
    bare = Tokenizer.from_str(json.dumps(saved))
    expected = [e.ids for e in bare.encode_batch(LITERAL_TEXTS, add_special_tokens=False)]
    assert encode_texts(loaded, LITERAL_TEXTS) == expected


def test_special_token_literals_in_glue_examples_and_corpus(corpus_glob):
    """Fine-tuning rows keep a quoted ``<pad>`` inside the attention mask, and packed
    pretraining sequences hold only the separators and padding that packing put there."""
    import ml_collections

    from glue.data import encode_examples
    from glue.mlm import pack_corpus

    tokenizer = train_tokenizer(read_local_corpus(corpus_glob), 400)
    special = special_ids(tokenizer)
    split = encode_examples(
        [("a <pad> b <mask>", "<sep> c <cls> d <unk>")], [1], tokenizer, 64, special, 2
    )
    row = split.ids[split.offsets[0] : split.offsets[1]]
    seps = [i for i, t in enumerate(row) if t == special.sep]
    assert row[0] == special.cls and seps[-1] == len(row) - 1 and len(seps) == 2
    assert min(np.delete(row, [0, *seps])) >= NUM_SPECIAL
    batch = split.batch(np.array([0]), 64, special.pad)
    assert batch["mask"][0].sum() == len(row)  # every token of the example is attended

    docs = [f"doc {i} quotes {t} here" for i, t in enumerate(SPECIAL_TOKENS)]
    config = ml_collections.ConfigDict(
        {"seed": 0, "data": {"max_len": 16, "eval_fraction": 0.0, "eval_sequences_max": 1}}
    )
    data = pack_corpus(config, tokenizer, docs)
    for packed in (*data.train, *data.eval):  # padding only at the end of a row
        is_pad = packed == special.pad
        assert not (is_pad[:-1] & ~is_pad[1:]).any(), packed
    stream = np.concatenate([data.train[:, 1:], data.eval[:, 1:]]).reshape(-1)
    stream = stream[stream != special.pad]
    assert (np.concatenate([data.train[:, 0], data.eval[:, 0]]) == special.cls).all()
    assert (stream == special.sep).sum() == len(docs)  # one separator per document
    assert min(stream[stream != special.sep]) >= NUM_SPECIAL
    assert data.num_tokens == len(stream) + len(data.train) + len(data.eval)


def test_errors_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--corpus="):
        read_local_corpus(str(tmp_path / "nothing" / "*.txt"))
    with pytest.raises(FileNotFoundError, match="--tokenizer="):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--tokenizer="):
        load_tokenizer(str(bad))
    with pytest.raises(ValueError, match="model.vocab_size"):
        train_tokenizer(["a b c"], 100, field="model.vocab_size")
    with pytest.raises(FileNotFoundError, match="config.init_from="):
        find_checkpoint(str(tmp_path / "no_run"))
    with pytest.raises(FileNotFoundError, match="config.init_from="):
        find_checkpoint(str(tmp_path))


def test_over_long_pairs_are_an_error_unless_truncation_is_asked():
    from glue.data import encode_examples

    class Whitespace:  # one token per word: lengths are known exactly
        class _Enc:
            def __init__(self, ids):
                self.ids = ids

        def encode_batch(self, texts, add_special_tokens=False):
            return [self._Enc([10 + len(w) for w in t.split()]) for t in texts]

    texts = [("a b c d e f", "g h"), ("a", "b"), ("a b c d e f g", "h i j")]
    # Lengths with <cls> <sep> <sep>: 11, 5, 13; max_len 8 cuts two of three.
    with pytest.raises(ValueError) as err:
        encode_examples(texts, [0, 1, 0], Whitespace(), 8, SPECIAL, 2, truncate=False, where="x")
    assert "2 of 3 examples of x are longer than data.max_len=8" in str(err.value)
    assert "the longest has 13 tokens" in str(err.value) and "data.truncate=True" in str(err.value)
    split = encode_examples(texts, [0, 1, 0], Whitespace(), 8, SPECIAL, 2, truncate=True)
    assert (split.truncated, split.longest) == (2, 13)
    assert all(split.offsets[i + 1] - split.offsets[i] <= 8 for i in range(3))


def test_prepare_builds_each_task_as_array_record(tmp_path):
    from glue import prepare

    calls = []

    class Builder:
        def __init__(self, name, data_dir):
            self.name, self.data_dir = name, os.path.join(data_dir, name)

        def download_and_prepare(self, file_format):
            calls.append((self.name, file_format))

    made = prepare.prepare(
        ["sst2", "mnli"], str(tmp_path), corpus="wikipedia/20230601.en", builder_fn=Builder
    )
    assert calls == [
        ("glue/sst2", "array_record"),
        ("glue/mnli", "array_record"),
        ("wikipedia/20230601.en", "array_record"),
    ]
    assert made["glue/mnli"] == os.path.join(str(tmp_path), "glue/mnli")
    with pytest.raises(ValueError, match="--tasks: 'cola' is not a GLUE task"):
        prepare.prepare(["cola"], str(tmp_path), builder_fn=Builder)


def test_prepare_refuses_nothing_to_do_and_an_unknown_corpus_before_any_download(tmp_path, capsys):
    from glue import prepare

    assert prepare.main(["--tasks="]) == 2
    assert capsys.readouterr().err == (
        "error: --tasks is empty and there is no --corpus: nothing to prepare\n"
    )
    downloads = []

    class Builder:
        def __init__(self, name, data_dir=None):
            if name == "nope/1.0":
                raise ValueError("Dataset nope not found.\nAvailable: ...")
            self.data_dir = str(tmp_path / name)

        def download_and_prepare(self, file_format):
            downloads.append(self.data_dir)

    with pytest.raises(ValueError, match=r"^--corpus: no TFDS builder 'nope/1.0' \(Dataset"):
        prepare.prepare(["sst2"], str(tmp_path), corpus="nope/1.0", builder_fn=Builder)
    assert downloads == []  # the task's download did not start before the corpus failed


def test_prepare_offline_is_one_error_line(tmp_path, capsys, monkeypatch):
    # No network here: the builder raises what requests raises offline (after TFDS's
    # retries), and the command must say which dataset failed, in one line, exit 2.
    import requests
    import tensorflow_datasets as tfds

    from glue import prepare

    class Offline:
        def __init__(self, name, data_dir):
            self.name = name

        def download_and_prepare(self, file_format):
            raise requests.exceptions.ConnectionError(
                "Max retries exceeded (Caused by NameResolutionError: Failed to resolve "
                "'dl.fbaipublicfiles.com')"
            )

    monkeypatch.setattr(tfds, "builder", Offline)
    assert prepare.main(["--tasks=sst2", f"--data_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: could not download glue/sst2 ")
    assert "dl.fbaipublicfiles.com" in err and "needs network access once" in err
