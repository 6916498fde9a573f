"""Retrieval builder on release-format TSVs written by the test."""

from __future__ import annotations

import numpy as np
import pytest
from tensorflow_datasets.core.download import DownloadConfig

from lra import builders, vocab
from lra.builders import retrieval
from lra.input_pipeline import open_split

ROWS = {
    "train": [
        ("1", "A00-1001", "P05-2002", "Citing text one. Ünïcode ✓", "Cited text one."),
        ("0.0", "A00-1002", "P05-2003", "Another paper", "Unrelated paper body"),
        ("1.0", "A00-1003", "P05-2004", "x" * 50, "y" * 7),
    ],
    "validation": [("0", "B1", "B2", "eval doc a", "eval doc b")],
    "test": [("1", "C1", "C2", "test doc a", "test doc b")],
}


def _write(manual, rows=ROWS, extra: dict | None = None):
    manual.mkdir(parents=True, exist_ok=True)
    for split, name in retrieval.RELEASE_FILES.items():
        lines = ["\t".join(r) for r in rows[split]]
        if extra and split in extra:
            lines.append(extra[split])
        (manual / name).write_bytes(("\n".join(lines) + "\n").encode("utf-8"))


def _prepare(tmp_path, manual, max_length=4096):
    b = builders.make_builder(
        "retrieval",
        builders.make_config("retrieval", max_length=max_length),
        data_dir=str(tmp_path / "data"),
    )
    b.download_and_prepare(
        file_format="array_record", download_config=DownloadConfig(manual_dir=str(manual))
    )
    return b


@pytest.mark.parametrize("max_length", [4096, 20])
def test_retrieval_pairs(tmp_path, max_length):
    _write(tmp_path / "manual")
    b = _prepare(tmp_path, tmp_path / "manual", max_length)
    for split, rows in ROWS.items():
        src = open_split(str(tmp_path / "data"), "retrieval", split, b.builder_config.name)
        got = {
            (vocab.decode_bytes(src[i]["inputs0"]), vocab.decode_bytes(src[i]["inputs1"])): int(
                src[i]["targets"]
            )
            for i in range(len(src))
        }
        want = {
            (r[3].encode()[:max_length], r[4].encode()[:max_length]): int(float(r[0])) for r in rows
        }
        assert got == want
        ex = src[0]
        assert ex["inputs0"].min() >= 1 and ex["inputs0"].max() <= 256


@pytest.mark.parametrize(
    "bad, message",
    [
        ("1\tX\tY\tonly four", "expected 5 tab-separated columns, got 4"),
        ("yes\tX\tY\ta\tb", "label 'yes' is not an integer"),
        ("0.5\tX\tY\ta\tb", "label '0.5' is not an integer"),
        ("2\tX\tY\ta\tb", "label 2 is outside 0..1"),
        ("1\tX\tY\t\tb", "empty text1"),
        ("1\tX\tY\ta\t  ", "empty text2"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, bad, message):
    manual = tmp_path / "manual"
    _write(manual, extra={"validation": bad})
    with pytest.raises(builders.MalformedFileError) as err:
        _prepare(tmp_path, manual)
    path = manual / retrieval.RELEASE_FILES["validation"]
    assert f"{path}:2: " in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize("content", [b"", b"label\tid1\tid2\ttext1\ttext2\n"])
def test_a_file_without_examples_is_named(tmp_path, content):
    # TFDS's own error ("No examples were yielded") names neither the file nor the cause.
    manual = tmp_path / "manual"
    _write(manual)
    path = manual / retrieval.RELEASE_FILES["test"]
    path.write_bytes(content)
    with pytest.raises(builders.MalformedFileError, match="no examples") as err:
        _prepare(tmp_path, manual)
    assert str(err.value).startswith(f"{path}:1: ")


def test_missing_files_message(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    (manual / "new_aan_pairs.train.tsv").write_text("1\ta\tb\tc\td\n")
    with pytest.raises(builders.MissingFilesError) as err:
        _prepare(tmp_path, manual)
    text = str(err.value)
    for part in (
        "new_aan_pairs.eval.tsv",
        "new_aan_pairs.test.tsv",
        str(manual),
        "tsv_data",
        builders.LRA_RELEASE_URL,
    ):
        assert part in text
    assert "Found only" in text


def test_byte_encoding_roundtrip():
    data = "naïve ✓ text".encode()
    ids = vocab.encode_bytes(data)
    assert ids.dtype == np.int32 and ids.min() >= 1
    assert vocab.decode_bytes(np.concatenate([ids, [0, 0]])) == data
