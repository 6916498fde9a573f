"""Image: CIFAR-10 as 1,024 grey pixel tokens (10 classes), from the TFDS catalog `cifar10`."""

from __future__ import annotations

import os

import numpy as np
import tensorflow_datasets as tfds

from lra.builders import common

CATALOG_NAME = "cifar10"
# The reference configs: the last 5,000 training images are the validation set.
CATALOG_SPLITS = {"train": "train[:45000]", "validation": "train[45000:]", "test": "test"}
_GREY_WEIGHTS = np.asarray([0.2989, 0.5870, 0.1140], dtype=np.float32)


def rgb_to_grey(image: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] -> uint8 [...], exactly as `tf.image.rgb_to_grayscale` on uint8.

    TF converts to float32 in [0, 1], takes the weighted sum, and converts back by
    multiplying with 255.5 and truncating.
    """
    if image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"rgb_to_grey needs uint8 [..., 3], got {image.dtype} {image.shape}")
    unit = image.astype(np.float32) * np.float32(1.0 / 255.0)
    grey = unit @ _GREY_WEIGHTS
    return (grey * np.float32(255.5)).astype(np.uint8)


class LraImage(tfds.core.GeneratorBasedBuilder):
    """CIFAR-10 images, grey, flattened row-major to 1,024 uint8 tokens."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def __init__(self, *, catalog_data_dir: str | os.PathLike | None = None, **kwargs):
        """catalog_data_dir: where `cifar10` is (or gets) prepared; default data_dir."""
        super().__init__(**kwargs)
        self._catalog_data_dir = catalog_data_dir

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "inputs": tfds.features.Tensor(shape=(1024,), dtype=np.uint8),
                    "targets": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("inputs", "targets"),
            homepage="https://www.cs.toronto.edu/~kriz/cifar.html",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        return common.catalog_split_generators(self, CATALOG_NAME, CATALOG_SPLITS)

    def _generate_examples(self, source, split: str):
        for index in range(len(source)):
            example = source[index]
            image = np.asarray(example["image"])
            if image.shape != (32, 32, 3):
                raise ValueError(
                    f"{CATALOG_NAME} split {split!r} example {index}: image shape "
                    f"{image.shape}, expected (32, 32, 3)"
                )
            yield (
                index,
                {
                    "inputs": rgb_to_grey(image).reshape(1024),
                    "targets": int(example["label"]),
                },
            )
