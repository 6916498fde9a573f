"""Pretraining text: local files or a TFDS text builder, and packing into sequences.

Local files (``--corpus=path/*.txt``): each file is split into documents at blank lines
(one or more empty or whitespace-only lines); lines within a document are joined with a
space. TFDS (``data.tfds_name``, e.g. ``wikipedia/20230601.en``): every example's
``data.tfds_text_key`` feature is one document (its paragraphs are not split, and
``data.max_documents`` counts examples), read with ``tfds.data_source`` (no
TensorFlow needed, but the dataset must already be prepared in array_record format or be
downloadable).

Packing (RoBERTa's FULL-SENTENCES): documents are concatenated into one token stream,
each followed by ``<sep>``; the stream is cut into chunks of ``max_len - 1`` tokens and
each chunk gets a leading ``<cls>``. The last chunk is padded with ``<pad>``.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


def join_lines(text: str) -> str:
    """The non-blank lines of ``text``, stripped and joined with one space."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def split_documents(text: str) -> list[str]:
    """Blank-line-separated blocks of ``text``, whitespace-normalised, empty ones dropped."""
    docs = []
    for block in _BLANK_LINES.split(text.replace("\r\n", "\n")):
        doc = join_lines(block)
        if doc:
            docs.append(doc)
    return docs


def corpus_files(pattern: str, flag: str = "--corpus") -> list[str]:
    """Sorted files matching a glob (comma-separated globs allowed); errors name ``flag``."""
    if not pattern:
        raise ValueError(f"{flag} is empty; give a glob such as {flag}=data/*.txt")
    files: list[str] = []
    for part in pattern.split(","):
        files.extend(p for p in glob.glob(os.path.expanduser(part.strip())) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(f"{flag}={pattern!r} matches no files")
    return sorted(set(files))


def read_local_corpus(pattern: str, flag: str = "--corpus") -> list[str]:
    """Documents of every file matching ``pattern`` (UTF-8; undecodable bytes replaced)."""
    docs: list[str] = []
    for path in corpus_files(pattern, flag):
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.extend(split_documents(f.read()))
    if not docs:
        raise ValueError(f"{flag}={pattern!r}: the files hold no text")
    return docs


def iter_tfds_corpus(
    name: str,
    split: str,
    text_key: str,
    data_dir: str | None = None,
    max_documents: int = 0,
    download: bool = False,
) -> Iterator[str]:
    """Documents of a TFDS text builder (``data.tfds_name``), via ``tfds.data_source``.

    Args:
      name: builder name with optional config/version, e.g. ``wikipedia/20230601.en``.
      split: TFDS split, e.g. ``train``.
      text_key: the feature holding the text (``data.tfds_text_key``).
      data_dir: TFDS data directory (None: the TFDS default).
      max_documents: read this many examples (0: all).

    Each example is one document, however many paragraphs it holds (its lines joined
    with a space, as within a local file's document); an example without text gives
    none.
      download: let TFDS download and prepare missing data (``data.tfds_download``).
    """
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text  # noqa: F401  (registers text builders without TF)

    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    except Exception as e:  # TFDS raises several types for a missing or unknown dataset
        raise ValueError(
            f"data.tfds_name={name!r} (split {split!r}) cannot be read with tfds.data_source: {e}"
        ) from None
    count = len(source) if not max_documents else min(len(source), max_documents)
    for i in range(count):
        example = source[i]
        if text_key not in example:
            raise ValueError(
                f"data.tfds_text_key={text_key!r} is not a feature of {name!r}; "
                f"features: {sorted(example)}"
            )
        text = example[text_key]
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        doc = join_lines(text)
        if doc:
            yield doc


def pack_sequences(
    documents: Sequence[Sequence[int]], max_len: int, cls_id: int, sep_id: int, pad_id: int
) -> np.ndarray:
    """Pack tokenised documents into ``[num_sequences, max_len]`` int32 rows.

    Each row is ``<cls>`` followed by ``max_len - 1`` stream tokens, where the stream is
    ``doc_0 <sep> doc_1 <sep> ...``; the last row is padded with ``pad_id``.
    """
    if max_len < 2:
        raise ValueError(f"data.max_len={max_len} must be at least 2")
    pieces = []
    sep = np.asarray([sep_id], np.int32)
    for doc in documents:
        if len(doc):
            pieces.append(np.asarray(doc, np.int32))
            pieces.append(sep)
    if not pieces:
        raise ValueError("the corpus gives no tokens to pack")
    stream = np.concatenate(pieces)
    chunk = max_len - 1
    rows = -(-len(stream) // chunk)
    body = np.full((rows * chunk,), pad_id, np.int32)
    body[: len(stream)] = stream
    body = body.reshape(rows, chunk)
    return np.concatenate([np.full((rows, 1), cls_id, np.int32), body], axis=1)
