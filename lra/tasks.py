"""Per-task metadata of the LRA benchmark, in one place.

`TASKS[name]` says what a model needs (vocabulary size, classes, sequence length,
one or two inputs) and where the data lives (TFDS builder and default config, and
which stored split serves as train / validation / test).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from lra import vocab


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Static facts of one LRA task.

    Attributes:
      name: task name, the key in `TASKS`.
      builder_name: TFDS builder name (data lives in <data_dir>/<builder_name>/<config>/).
      default_config: builder config of the reference setup (what `lra.prepare` builds
        without options); reduced setups get other config names.
      vocab_size: token ids are in [0, vocab_size).
      num_classes: classification classes.
      max_length: padded sequence length of the reference setup (per document for
        Retrieval).
      dual_input: True for Retrieval (two documents per example).
      splits: pipeline split name -> stored split name.
      padding_id: the id used for padding (for pixel tasks padding never happens).
      fixed_length: every stored example has exactly ``max_length`` tokens (the pixel
        tasks: a 32x32 image is 1024 pixels), so lengths need no scan.
    """

    name: str
    builder_name: str
    default_config: str | None
    vocab_size: int
    num_classes: int
    max_length: int
    dual_input: bool
    splits: Mapping[str, str]
    padding_id: int = vocab.PAD_ID
    fixed_length: bool = False


_STANDARD_SPLITS = {"train": "train", "validation": "validation", "test": "test"}

TASKS: dict[str, TaskSpec] = {
    "listops": TaskSpec(
        name="listops",
        builder_name="lra_listops",
        default_config="generated",
        vocab_size=vocab.LISTOPS_VOCAB_SIZE,
        num_classes=10,
        max_length=2000,
        dual_input=False,
        splits=_STANDARD_SPLITS,
    ),
    "text": TaskSpec(
        name="text",
        builder_name="lra_text",
        default_config="bytes3072",
        vocab_size=vocab.BYTE_VOCAB_SIZE,
        num_classes=2,
        max_length=3072,
        dual_input=False,
        # As LRA: IMDB has no validation split, the test split serves both.
        splits={"train": "train", "validation": "test", "test": "test"},
    ),
    "retrieval": TaskSpec(
        name="retrieval",
        builder_name="lra_retrieval",
        default_config="bytes4096",
        vocab_size=vocab.BYTE_VOCAB_SIZE,
        num_classes=2,
        max_length=4096,
        dual_input=True,
        splits=_STANDARD_SPLITS,
    ),
    "image": TaskSpec(
        name="image",
        builder_name="lra_image",
        default_config=None,
        vocab_size=vocab.PIXEL_VOCAB_SIZE,
        num_classes=10,
        max_length=1024,
        dual_input=False,
        splits=_STANDARD_SPLITS,
        fixed_length=True,
    ),
    "pathfinder": TaskSpec(
        name="pathfinder",
        builder_name="lra_pathfinder",
        default_config="generated_hard",
        vocab_size=vocab.PIXEL_VOCAB_SIZE,
        num_classes=2,
        max_length=1024,
        dual_input=False,
        splits=_STANDARD_SPLITS,
        fixed_length=True,
    ),
}


def get_task(name: str) -> TaskSpec:
    """`TASKS[name]` with an error that lists the valid names."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown LRA task {name!r}; choose from {sorted(TASKS)}") from None
