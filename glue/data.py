"""GLUE fine-tuning data: TFDS ``glue/<task>`` read with ``tfds.data_source`` (no
TensorFlow), tokenised, sentence pairs joined with ``<sep>``.

An example becomes ``<cls> a <sep>`` (single sentence) or ``<cls> a <sep> b <sep>``
(pair), truncated longest-first to ``max_len`` and padded with ``<pad>``. Encoded
examples are kept ragged (flat ids + offsets) and padded per batch, so a large task
(QQP, MNLI) costs memory in proportion to its text, not to ``N * max_len``.

Batches of step ``s`` come from a stream of per-epoch permutations seeded by
``(seed, epoch)``, so a restarted run sees the same data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from glue.tokenizer import SpecialIds


@dataclasses.dataclass(frozen=True)
class GlueTaskSpec:
    """One GLUE task.

    Attributes:
      name: our name (``task.name`` in the fine-tuning config).
      tfds_name: TFDS builder/config.
      text_keys: one or two text features; two are joined with ``<sep>``.
      num_classes: label count.
      eval_splits: validation splits reported in the summary.
      metric: the headline metric of Table 4: "f1" (binary) or "macro_f1" (MNLI).
    """

    name: str
    tfds_name: str
    text_keys: tuple[str, ...]
    num_classes: int
    eval_splits: tuple[str, ...]
    metric: str


GLUE_TASKS: dict[str, GlueTaskSpec] = {
    "sst2": GlueTaskSpec("sst2", "glue/sst2", ("sentence",), 2, ("validation",), "f1"),
    "qqp": GlueTaskSpec("qqp", "glue/qqp", ("question1", "question2"), 2, ("validation",), "f1"),
    "mnli": GlueTaskSpec(
        "mnli",
        "glue/mnli",
        ("premise", "hypothesis"),
        3,
        ("validation_matched", "validation_mismatched"),
        "macro_f1",
    ),
    "qnli": GlueTaskSpec("qnli", "glue/qnli", ("question", "sentence"), 2, ("validation",), "f1"),
}


def get_task_spec(name: str) -> GlueTaskSpec:
    """The spec of ``task.name``; an unknown name's error names the field."""
    if name not in GLUE_TASKS:
        raise ValueError(
            f"task.glue_task={name!r} is not a GLUE task; choose one of {sorted(GLUE_TASKS)}"
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


@dataclasses.dataclass
class EncodedSplit:
    """A tokenised split: ragged ids and labels.

    Attributes:
      ids: int32 [total tokens], examples back to back.
      offsets: int64 [num_examples + 1]; example i is ``ids[offsets[i]:offsets[i+1]]``.
      labels: int32 [num_examples].
    """

    ids: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray

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
            "targets": self.labels[indices].astype(np.int32),
        }


def encode_examples(
    texts: Sequence[Sequence[str]],
    labels: Sequence[int],
    tokenizer,
    max_len: int,
    special: SpecialIds,
    num_classes: int,
) -> EncodedSplit:
    """Tokenise examples given as tuples of 1 or 2 texts (with their labels)."""
    columns = list(zip(*texts, strict=True)) if texts else []
    encoded = [
        [e.ids for e in tokenizer.encode_batch(list(col), add_special_tokens=False)]
        for col in columns
    ]
    rows = []
    for i in range(len(texts)):
        b = encoded[1][i] if len(encoded) > 1 else None
        rows.append(join_pair(encoded[0][i], b, max_len, special))
    labels = np.asarray(labels, np.int32).reshape(-1)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels outside [0, {num_classes}) (unlabelled test split?): {np.unique(labels)}"
        )
    lengths = np.asarray([len(r) for r in rows], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate([np.asarray(r, np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    return EncodedSplit(ids=ids, offsets=offsets, labels=labels)


def load_glue_split(
    spec: GlueTaskSpec,
    split: str,
    tokenizer,
    max_len: int,
    special: SpecialIds,
    data_dir: str | None = None,
    max_examples: int = 0,
    download: bool = False,
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
    """
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text  # noqa: F401  (registers the glue builder without TF)

    try:
        source = tfds.data_source(spec.tfds_name, split=split, data_dir=data_dir, download=download)
    except Exception as e:  # TFDS raises several types for unprepared data
        hint = "" if download else " (data.tfds_download=False: nothing is downloaded)"
        raise ValueError(
            f"cannot read {spec.tfds_name!r} split {split!r} (--data_dir={data_dir!r}) with "
            f"tfds.data_source{hint}: {e}"
        ) from None
    count = len(source) if not max_examples else min(len(source), max_examples)
    texts, labels = [], []
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
    if not texts:
        raise ValueError(f"{spec.tfds_name!r} split {split!r} is empty")
    return encode_examples(texts, labels, tokenizer, max_len, special, spec.num_classes)


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
