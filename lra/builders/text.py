"""Text: IMDB reviews at byte level (2 classes), from the TFDS catalog `imdb_reviews`."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow_datasets as tfds

from lra import vocab
from lra.builders import common

# Like the LRA text pipeline: train on imdb 'train', evaluate and test on imdb 'test'.
CATALOG_NAME = "imdb_reviews"
CATALOG_SPLITS = {"train": "train", "test": "test"}


@dataclasses.dataclass
class TextConfig(tfds.core.BuilderConfig):
    """max_length: reviews are cut to this many bytes (3072 in the paper, 4000 in LRA)."""

    max_length: int = 3072


def make_config(max_length: int = 3072) -> TextConfig:
    if max_length < 1:
        raise ValueError(f"Text max_length must be >= 1, got {max_length}")
    return TextConfig(
        name=f"bytes{max_length}",
        max_length=max_length,
        description=f"UTF-8 bytes of each review, first {max_length}",
    )


class LraText(tfds.core.GeneratorBasedBuilder):
    """IMDB reviews as byte tokens (byte b -> id b + 1; 0 is padding)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [make_config(3072), make_config(4096), make_config(4000)]

    def __init__(self, *, catalog_data_dir: str | os.PathLike | None = None, **kwargs):
        """catalog_data_dir: where `imdb_reviews` is (or gets) prepared; default data_dir."""
        super().__init__(**kwargs)
        self._catalog_data_dir = catalog_data_dir

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "inputs": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "targets": tfds.features.ClassLabel(num_classes=2),
                }
            ),
            supervised_keys=("inputs", "targets"),
            homepage="https://ai.stanford.edu/~amaas/data/sentiment/",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        return common.catalog_split_generators(self, CATALOG_NAME, CATALOG_SPLITS)

    def _generate_examples(self, source, split: str):
        max_length = self.builder_config.max_length
        for index in range(len(source)):
            example = source[index]
            text = example["text"]
            if isinstance(text, str):
                text = text.encode("utf-8")
            if not text:
                raise ValueError(f"{CATALOG_NAME} split {split!r} example {index}: empty text")
            label = int(example["label"])
            if label not in (0, 1):
                raise ValueError(
                    f"{CATALOG_NAME} split {split!r} example {index}: label {label} not in 0..1"
                )
            yield index, {"inputs": vocab.encode_bytes(text, max_length), "targets": label}
