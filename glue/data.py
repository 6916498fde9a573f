"""GLUE fine-tuning data: TFDS ``glue/<task>`` read with ``tfds.data_source`` (no
TensorFlow), tokenised, sentence pairs joined with ``<sep>``.

An example becomes ``<cls> a <sep>`` (single sentence) or ``<cls> a <sep> b <sep>``
(pair), padded with ``<pad>``. An example longer than ``max_len`` is an error naming
the split, how many there are and the longest length, unless ``data.truncate`` asks to
cut them (longest-first, BERT's practice), which is then counted and reported. Encoded
examples are kept ragged (flat ids + offsets) and padded per batch, so a large task
(QQP, MNLI) costs memory in proportion to its text, not to ``N * max_len``.

Batches of step ``s`` come from a stream of per-epoch permutations seeded by
``(seed, epoch)``, so a restarted run sees the same data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from glue.tokenizer import SpecialIds, encode_texts


@dataclasses.dataclass(frozen=True)
class GlueTaskSpec:
    """One GLUE task.

    Attributes:
      name: our name (``task.name`` in the fine-tuning config).
      tfds_name: TFDS builder/config.
      text_keys: one or two text features; two are joined with ``<sep>``.
      num_classes: label count.
      eval_splits: validation splits reported in the summary (the first is the dev
        split that picks the best checkpoint).
      metric: the headline metric of Table 4: "f1" (binary) or "macro_f1" (MNLI).
      test_files: unlabelled test split -> its file in the GLUE submission
        (``<name>.tsv``, columns ``index`` and ``prediction``).
      label_names: the submission's label strings by class id (None: the ids).
    """

    name: str
    tfds_name: str
    text_keys: tuple[str, ...]
    num_classes: int
    eval_splits: tuple[str, ...]
    metric: str
    test_files: tuple[tuple[str, str], ...] = ()
    label_names: tuple[str, ...] | None = None


GLUE_TASKS: dict[str, GlueTaskSpec] = {
    "sst2": GlueTaskSpec(
        "sst2", "glue/sst2", ("sentence",), 2, ("validation",), "f1", (("test", "SST-2"),)
    ),
    "qqp": GlueTaskSpec(
        "qqp",
        "glue/qqp",
        ("question1", "question2"),
        2,
        ("validation",),
        "f1",
        (("test", "QQP"),),
    ),
    "mnli": GlueTaskSpec(
        "mnli",
        "glue/mnli",
        ("premise", "hypothesis"),
        3,
        ("validation_matched", "validation_mismatched"),
        "macro_f1",
        (("test_matched", "MNLI-m"), ("test_mismatched", "MNLI-mm")),
        ("entailment", "neutral", "contradiction"),  # TFDS glue/mnli label order
    ),
    "qnli": GlueTaskSpec(
        "qnli",
        "glue/qnli",
        ("question", "sentence"),
        2,
        ("validation",),
        "f1",
        (("test", "QNLI"),),
        ("entailment", "not_entailment"),  # TFDS glue/qnli label order
    ),
}


def get_task_spec(name: str) -> GlueTaskSpec:
    """The spec of ``task.name``; an unknown name's error names the field."""
    if name not in GLUE_TASKS:
        raise ValueError(
            f"task.name='glue_{name}' is not a GLUE task; choose one of "
            f"{['glue_' + t for t in sorted(GLUE_TASKS)]}"
        )
    return GLUE_TASKS[name]


def join_pair(
    a: Sequence[int], b: Sequence[int] | None, max_len: int, special: SpecialIds
) -> list[int]:
    """``<cls> a <sep> [b <sep>]`` truncated longest-first to at most ``max_len`` ids."""
    a, b = list(a), (None if b is None else list(b))
    budget = max_len - (2 if b is None else 3)
    if budget < (1 if b is None else 2):
        raise ValueError(f"data.max_len={max_len} is too short for a GLUE example")
    if b is None:
        return [special.cls, *a[:budget], special.sep]
    while len(a) + len(b) > budget:
        if len(a) >= len(b):
            a.pop()
        else:
            b.pop()
    return [special.cls, *a, special.sep, *b, special.sep]


def pair_length(a: Sequence[int], b: Sequence[int] | None) -> int:
    """Tokens of ``<cls> a <sep> [b <sep>]`` before any truncation."""
    return len(a) + 2 if b is None else len(a) + len(b) + 3


@dataclasses.dataclass
class EncodedSplit:
    """A tokenised split: ragged ids and labels.

    Attributes:
      ids: int32 [total tokens], examples back to back.
      offsets: int64 [num_examples + 1]; example i is ``ids[offsets[i]:offsets[i+1]]``.
      labels: int32 [num_examples] (-1 in an unlabelled test split).
      index: int64 [num_examples], the examples' ids (TFDS ``idx``; default 0..n-1).
      truncated: examples cut to ``max_len``; longest: the longest before cutting.
    """

    ids: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    index: np.ndarray | None = None
    truncated: int = 0
    longest: int = 0

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, indices: np.ndarray, max_len: int, pad_id: int) -> dict[str, np.ndarray]:
        """Rows ``indices`` padded to ``max_len``: inputs, mask, targets."""
        inputs = np.full((len(indices), max_len), pad_id, np.int32)
        for row, i in enumerate(indices):
            start, end = self.offsets[i], self.offsets[i + 1]
            inputs[row, : end - start] = self.ids[start:end]
        return {
            "inputs": inputs,
            "mask": inputs != pad_id,
            "targets": np.maximum(self.labels[indices], 0).astype(np.int32),
        }

    def padded_batches(
        self, batch_size: int, max_len: int, pad_id: int
    ) -> list[dict[str, np.ndarray]]:
        """Every example once, in order, in batches of ``batch_size``; the last batch is
        filled by repeating real rows with ``example_mask`` (and ``weights``) 0. Each
        batch also carries ``index`` (the examples' ids)."""
        out = []
        for start in range(0, len(self), batch_size):
            rows = np.arange(start, start + batch_size)
            real = rows < len(self)
            rows = np.where(real, rows, rows % len(self))
            batch = self.batch(rows, max_len, pad_id)
            batch["example_mask"] = real
            batch["weights"] = real.astype(np.float32)
            index = self.index if self.index is not None else np.arange(len(self))
            batch["index"] = index[rows].astype(np.int64)
            out.append(batch)
        return out


def encode_examples(
    texts: Sequence[Sequence[str]],
    labels: Sequence[int],
    tokenizer,
    max_len: int,
    special: SpecialIds,
    num_classes: int,
    *,
    truncate: bool = True,
    unlabelled: bool = False,
    index: Sequence[int] | None = None,
    where: str = "the examples",
) -> EncodedSplit:
    """Tokenise examples given as tuples of 1 or 2 texts (with their labels).

    Examples longer than ``max_len`` are cut longest-first with ``truncate`` (counted in
    ``truncated``), else they raise a ``ValueError`` naming ``where``, the count and the
    longest length. ``unlabelled``: a GLUE test split, whose labels are hidden (stored as -1).
    """
    columns = list(zip(*texts, strict=True)) if texts else []
    encoded = [encode_texts(tokenizer, col) for col in columns]  # plain text: no special ids
    rows, truncated, longest = [], 0, 0
    for i in range(len(texts)):
        b = encoded[1][i] if len(encoded) > 1 else None
        full = pair_length(encoded[0][i], b)
        longest = max(longest, full)
        truncated += full > max_len
        rows.append(join_pair(encoded[0][i], b, max_len, special))
    if truncated and not truncate:
        raise ValueError(
            f"{truncated} of {len(texts)} examples of {where} are longer than "
            f"data.max_len={max_len} (the longest has {longest} tokens); set "
            "data.truncate=True to cut them longest-first, or raise data.max_len"
        )
    labels = np.asarray(labels, np.int32).reshape(-1)
    if unlabelled:
        labels = np.full(labels.shape, -1, np.int32)  # GLUE's test labels are hidden
    elif labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels outside [0, {num_classes}) (unlabelled test split?): {np.unique(labels)}"
        )
    lengths = np.asarray([len(r) for r in rows], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate([np.asarray(r, np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    index_arr = (
        np.arange(len(rows), dtype=np.int64) if index is None else np.asarray(index, np.int64)
    )
    return EncodedSplit(ids, offsets, labels, index_arr, truncated, longest)


def load_glue_split(
    spec: GlueTaskSpec,
    split: str,
    tokenizer,
    max_len: int,
    special: SpecialIds,
    data_dir: str | None = None,
    max_examples: int = 0,
    download: bool = False,
    truncate: bool = True,
) -> EncodedSplit:
    """Read and tokenise one split of a GLUE task through ``tfds.data_source``.

    Args:
      spec: the task.
      split: TFDS split name ("train", "validation", "validation_matched", ...).
      tokenizer: a ``tokenizers.Tokenizer``.
      max_len: padded length (``data.max_len``).
      special: special-token ids.
      data_dir: TFDS data directory (``--data_dir``; None: the TFDS default).
      max_examples: read only the first this many (0: all).
      download: let TFDS download and prepare missing data (``data.tfds_download``).
      truncate: cut over-long examples (``data.truncate``); else they are an error.
    """
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text  # noqa: F401  (registers the glue builder without TF)

    try:
        source = tfds.data_source(spec.tfds_name, split=split, data_dir=data_dir, download=download)
    except Exception as e:  # TFDS raises several types for unprepared data
        hint = (
            ""
            if download
            else " (data.tfds_download=False: nothing is downloaded; prepare it once with "
            f"`python -m glue.prepare --tasks={spec.name}`)"
        )
        raise ValueError(
            f"cannot read {spec.tfds_name!r} split {split!r} (data.tfds_data_dir="
            f"{data_dir!r}) with tfds.data_source{hint}: {' '.join(str(e).split())[:300]}"
        ) from None
    count = len(source) if not max_examples else min(len(source), max_examples)
    texts, labels, index = [], [], []
    for i in range(count):
        example = source[i]
        fields = []
        for key in spec.text_keys:
            value = example[key]
            fields.append(
                value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            )
        texts.append(tuple(fields))
        labels.append(int(example["label"]))
        index.append(int(example.get("idx", i)))
    if not texts:
        raise ValueError(f"{spec.tfds_name!r} split {split!r} is empty")
    return encode_examples(
        texts,
        labels,
        tokenizer,
        max_len,
        special,
        spec.num_classes,
        truncate=truncate,
        unlabelled=split.startswith("test"),
        index=index,
        where=f"{spec.tfds_name} split {split!r}",
    )


class EpochStream:
    """Indices of batch ``step``: consecutive slices of a stream of per-epoch
    permutations of ``range(num_examples)``, epoch ``e`` shuffled by ``(seed, e)``."""

    def __init__(self, num_examples: int, batch_size: int, seed: int) -> None:
        if num_examples < 1:
            raise ValueError("cannot draw batches from an empty dataset")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self._epoch = -1
        self._perm = np.zeros(0, np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._epoch = epoch
        return self._perm

    def indices(self, step: int) -> np.ndarray:
        """int64 [batch_size] example indices of training step ``step``."""
        start = step * self.batch_size
        out = np.empty(self.batch_size, np.int64)
        for j in range(self.batch_size):
            epoch, offset = divmod(start + j, self.num_examples)
            out[j] = self._permutation(epoch)[offset]
        return out

    def iterate(self, start_step: int) -> Iterator[np.ndarray]:
        """Index arrays of steps ``start_step, start_step + 1, ...``."""
        step = start_step
        while True:
            yield self.indices(step)
            step += 1


def steps_for_epochs(num_examples: int, batch_size: int, epochs: float) -> int:
    """Optimizer steps covering ``epochs`` passes over ``num_examples`` (at least 1)."""
    return max(1, int(np.ceil(epochs * num_examples / batch_size)))
