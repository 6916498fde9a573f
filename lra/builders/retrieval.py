"""Retrieval: AAN citation pairs at byte level (2 classes, two documents), release TSVs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow_datasets as tfds

from lra import vocab
from lra.builders import common

RELEASE_FILES = {
    "train": "new_aan_pairs.train.tsv",
    "validation": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}
RELEASE_SUBDIR = "tsv_data"
COLUMNS = ("label", "id1", "id2", "text1", "text2")


@dataclasses.dataclass
class RetrievalConfig(tfds.core.BuilderConfig):
    """max_length: each document is cut to this many bytes (4096 here, 4000 in LRA)."""

    max_length: int = 4096


def make_config(max_length: int = 4096) -> RetrievalConfig:
    if max_length < 1:
        raise ValueError(f"Retrieval max_length must be >= 1, got {max_length}")
    return RetrievalConfig(
        name=f"bytes{max_length}",
        max_length=max_length,
        description=f"UTF-8 bytes of each document, first {max_length}",
    )


class LraRetrieval(tfds.core.GeneratorBasedBuilder):
    """AAN document pairs; label 1 if one cites the other.  No header row in the files."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [make_config(4096), make_config(4000)]
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Put {', '.join(RELEASE_FILES.values())} (lra_release/{RELEASE_SUBDIR}/ in "
        f"{common.LRA_RELEASE_URL}) in the manual dir."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "inputs0": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "inputs1": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "targets": tfds.features.ClassLabel(num_classes=2),
                    "id0": tfds.features.Text(),
                    "id1": tfds.features.Text(),
                }
            ),
            homepage="https://aan.how/",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        paths = common.locate_release_files(
            "retrieval",
            common.manual_dir_of(dl_manager),
            list(RELEASE_FILES.values()),
            RELEASE_SUBDIR,
        )
        return {
            split: self._generate_examples(path=paths[name])
            for split, name in RELEASE_FILES.items()
        }

    def _generate_examples(self, path: str):
        yield from common.require_examples(self._release_examples(path), path)

    def _release_examples(self, path: str):
        max_length = self.builder_config.max_length
        for line, fields in common.iter_tsv(path, len(COLUMNS)):
            if line == 1 and fields[0].strip() == b"label":
                continue  # tolerate a header row
            label = common.parse_label(fields[0], 2, path, line, "label")
            for column, text in (("text1", fields[3]), ("text2", fields[4])):
                if not text.strip():
                    raise common.MalformedFileError(path, line, f"empty {column}")
            yield (
                f"{os.path.basename(path)}:{line}",
                {
                    "inputs0": vocab.encode_bytes(fields[3], max_length),
                    "inputs1": vocab.encode_bytes(fields[4], max_length),
                    "targets": label,
                    "id0": fields[1].decode("utf-8", "replace"),
                    "id1": fields[2].decode("utf-8", "replace"),
                },
            )
