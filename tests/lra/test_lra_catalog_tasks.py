"""Text (imdb_reviews) and Image (cifar10) builders on tfds.testing.mock_data."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow_datasets as tfds

from lra import builders
from lra.builders import common, image, text
from lra.input_pipeline import open_split


def _materialise_mock(name: str, splits: dict[str, str], num_examples: int) -> dict[str, list]:
    """The catalog examples that mock_data serves, as plain lists (per catalog split)."""
    with tfds.testing.mock_data(num_examples=num_examples):
        out = {}
        for split in splits.values():
            src = common.open_catalog_split(name, split, data_dir=None)
            out[split] = [src[i] for i in range(len(src))]
    return out


def _grey_reference(rgb: np.ndarray) -> np.ndarray:
    """tf.image.rgb_to_grayscale on uint8, written out in float64: floor(255.5 * y / 255)."""
    y = rgb.astype(np.float64) @ np.array([0.2989, 0.5870, 0.1140]) / 255.0
    return np.floor(y * 255.5).astype(np.uint8)


def test_open_catalog_split_under_mock_data():
    with tfds.testing.mock_data(num_examples=3):
        src = common.open_catalog_split("imdb_reviews", "train", data_dir=None)
        assert len(src) == 3
        assert {"text", "label"} <= set(src[0])
        src = common.open_catalog_split("cifar10", "train[:45000]", data_dir=None)
        assert src[0]["image"].shape == (32, 32, 3)


@pytest.mark.parametrize("max_length", [3072, 16])
def test_text_builder(tmp_path, monkeypatch, max_length):
    mocked = _materialise_mock("imdb_reviews", text.CATALOG_SPLITS, num_examples=5)
    monkeypatch.setattr(common, "open_catalog_split", lambda name, split, data_dir: mocked[split])
    config = builders.make_config("text", max_length=max_length)
    builders.make_builder("text", config, data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    for split, catalog_split in text.CATALOG_SPLITS.items():
        stored = open_split(
            str(tmp_path), "text", split if split == "train" else "test", config.name
        )
        want = {}
        for ex in mocked[catalog_split]:
            raw = ex["text"] if isinstance(ex["text"], bytes) else ex["text"].encode("utf-8")
            ids = np.array(list(raw[:max_length]), dtype=np.int32) + 1  # byte b -> b + 1
            want[ids.tobytes()] = int(ex["label"])
        got = {stored[i]["inputs"].tobytes(): int(stored[i]["targets"]) for i in range(len(stored))}
        assert got == want
        assert all(stored[i]["inputs"].shape[0] <= max_length for i in range(len(stored)))


def test_text_empty_review_is_an_error(tmp_path, monkeypatch):
    fake = {"train": [{"text": b"good", "label": 1}, {"text": b"", "label": 0}], "test": []}
    monkeypatch.setattr(common, "open_catalog_split", lambda name, split, data_dir: fake[split])
    b = builders.make_builder("text", builders.make_config("text"), data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="split 'train' example 1: empty text"):
        b.download_and_prepare(file_format="array_record")


def test_image_builder(tmp_path, monkeypatch):
    mocked = _materialise_mock("cifar10", image.CATALOG_SPLITS, num_examples=4)
    # mock_data draws random pixels; make one image saturated to pin the extremes.
    mocked["test"][0] = {"image": np.full((32, 32, 3), 255, np.uint8), "label": 3}
    monkeypatch.setattr(common, "open_catalog_split", lambda name, split, data_dir: mocked[split])
    builders.make_builder("image", None, data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    for split, catalog_split in image.CATALOG_SPLITS.items():
        stored = open_split(str(tmp_path), "image", split)
        want = {
            _grey_reference(np.asarray(ex["image"])).reshape(-1).tobytes(): int(ex["label"])
            for ex in mocked[catalog_split]
        }
        got = {stored[i]["inputs"].tobytes(): int(stored[i]["targets"]) for i in range(len(stored))}
        assert got == want
    assert image.rgb_to_grey(np.full((1, 3), 255, np.uint8))[0] == 255


def test_grey_matches_reference_on_all_channel_values():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(20000, 3), dtype=np.uint8)
    got = image.rgb_to_grey(rgb).astype(int)
    want = _grey_reference(rgb).astype(int)
    # float32 (as TF) vs float64 may differ by one grey level right at a boundary.
    assert np.abs(got - want).max() <= 1
    assert np.mean(got == want) > 0.999
