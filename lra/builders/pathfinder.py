"""Pathfinder 32x32 (2 classes): from the release image folders, or generated offline."""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from lra import pathfinder_generator
from lra.builders import common

DIFFICULTY_DIRS = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
RELEASE_SUBDIR = "pathfinder32"
# Files of the release that are known to be empty; they are skipped with a warning.
# Any other unreadable image is an error.
KNOWN_BROKEN_RELEASE_FILES = frozenset({"curv_baseline/imgs/0/sample_172.png"})
# The reference split of each difficulty's images: 80% / 10% / 10% in file order.
RELEASE_FRACTIONS = {"train": (0.0, 0.8), "validation": (0.8, 0.9), "test": (0.9, 1.0)}


def _fail(message: str):
    """A split generator that raises ``ValueError(message)`` when it is read."""
    raise ValueError(message)
    yield  # a generator: the error comes when TFDS reads this split, after the others


@dataclasses.dataclass
class PathfinderConfig(tfds.core.BuilderConfig):
    """source: 'generated' (our generator) or 'release'; difficulty easy|intermediate|hard."""

    source: str = "generated"
    difficulty: str = "hard"
    num_train: int = 160_000
    num_validation: int = 20_000
    num_test: int = 20_000
    seed: int = 0


def make_config(
    source: str = "generated",
    difficulty: str = "hard",
    *,
    num_train: int = 160_000,
    num_validation: int = 20_000,
    num_test: int = 20_000,
    seed: int = 0,
) -> PathfinderConfig:
    """A config whose name encodes every non-default setting."""
    if difficulty not in DIFFICULTY_DIRS:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY_DIRS)}, got {difficulty!r}")
    if source == "release":
        return PathfinderConfig(
            name=f"release_{difficulty}",
            source="release",
            difficulty=difficulty,
            description=f"LRA release pathfinder32/{DIFFICULTY_DIRS[difficulty]}",
        )
    if source != "generated":
        raise ValueError(f"Pathfinder source must be 'generated' or 'release', got {source!r}")
    sizes = (num_train, num_validation, num_test)
    if min(sizes) < 0 or max(sizes) == 0:
        raise ValueError(f"Pathfinder split sizes must be >= 0 and not all 0, got {sizes}")
    name = f"generated_{difficulty}"
    if sizes != (160_000, 20_000, 20_000):
        name += f"_n{num_train}-{num_validation}-{num_test}"
    if seed != 0:
        name += f"_seed{seed}"
    return PathfinderConfig(
        name=name,
        source="generated",
        difficulty=difficulty,
        num_train=num_train,
        num_validation=num_validation,
        num_test=num_test,
        seed=seed,
        description=f"generated {difficulty}: {num_train}/{num_validation}/{num_test}, seed {seed}",
    )


def _generate_one(params, seed: int, split: str, index: int) -> tuple[np.ndarray, int]:
    example = pathfinder_generator.generate_split_example(
        params, seed=seed, split=split, index=index
    )
    return example.image.reshape(-1), example.label


class LraPathfinder(tfds.core.GeneratorBasedBuilder):
    """Pathfinder images flattened row-major to 1,024 uint8 grey tokens."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        *(make_config("generated", d) for d in ("hard", "intermediate", "easy")),
        *(make_config("release", d) for d in ("hard", "intermediate", "easy")),
        make_config("generated", "hard", num_train=2000, num_validation=200, num_test=200),
    ]
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Only for configs 'release_*': put the release folder pathfinder32/ (from "
        f"{common.LRA_RELEASE_URL}) in the manual dir."
    )

    def __init__(self, *, num_workers: int = 1, **kwargs):
        """num_workers: processes for the generator (output does not depend on it)."""
        super().__init__(**kwargs)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._num_workers = num_workers

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "inputs": tfds.features.Tensor(shape=(1024,), dtype=np.uint8),
                    "targets": tfds.features.ClassLabel(num_classes=2),
                }
            ),
            supervised_keys=("inputs", "targets"),
            homepage="https://github.com/drewlinsley/pathfinder",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        cfg = self.builder_config
        if cfg.source == "release":
            rows = self._release_rows(common.manual_dir_of(dl_manager))
            out = {}
            for split, (lo, hi) in RELEASE_FRACTIONS.items():
                part = rows[int(round(lo * len(rows))) : int(round(hi * len(rows)))]
                if part:
                    out[split] = self._generate_examples(split=split, rows=part)
                else:  # TFDS cannot write an empty split; said when TFDS reaches it
                    where = os.path.dirname(rows[0][0]) if rows else "the release metadata"
                    out[split] = _fail(
                        f"{where}: {len(rows)} images are too few for the {split} split "
                        f"({hi - lo:.0%} of them): it would be empty"
                    )
            return out
        sizes = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}
        # A split of size 0 is left out (TFDS cannot write empty splits).
        return {split: self._generate_examples(split=split) for split, n in sizes.items() if n}

    def _generate_examples(self, split: str, rows: list | None = None):
        """Release: the given metadata rows.  Generated: `num_<split>` fresh images."""
        if rows is not None:
            yield from self._release_examples(rows)
            return
        cfg = self.builder_config
        num = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}
        params = pathfinder_generator.PathfinderParams.for_difficulty(cfg.difficulty)
        make = functools.partial(_generate_one, params, cfg.seed, split)
        indices = range(num[split])
        if self._num_workers == 1:
            results = map(make, indices)
            for index, (pixels, label) in zip(indices, results, strict=True):
                yield index, {"inputs": pixels, "targets": label}
            return
        with multiprocessing.get_context("spawn").Pool(self._num_workers) as pool:
            results = pool.imap(make, indices, chunksize=64)
            for index, (pixels, label) in zip(indices, results, strict=True):
                yield index, {"inputs": pixels, "targets": label}

    def _release_rows(self, manual_dir: str | None) -> list[tuple[str, int, str, int]]:
        """(metadata file, line, image path, label) for every image, in file order."""
        sub = DIFFICULTY_DIRS[self.builder_config.difficulty]
        base = None
        if manual_dir:
            for cand in (
                os.path.join(manual_dir, sub),
                os.path.join(manual_dir, RELEASE_SUBDIR, sub),
                os.path.join(manual_dir, "lra_release", RELEASE_SUBDIR, sub),
            ):
                if os.path.isdir(os.path.join(cand, "metadata")):
                    base = cand
                    break
        if base is None:
            # Absolute, as the other release tasks' messages give it.
            where = (
                os.path.abspath(os.path.expanduser(manual_dir))
                if manual_dir
                else "<manual_dir> (pass --manual_dir=DIR)"
            )
            raise common.MissingFilesError(
                f"LRA pathfinder ({self.builder_config.difficulty}): release folder not found.\n"
                f"Put the folder {RELEASE_SUBDIR}/{sub}/ (with imgs/ and metadata/*.npy) in "
                f"{where}, i.e. {where}/{RELEASE_SUBDIR}/{sub}/metadata/0.npy must exist "
                f"(or keep the release layout {where}/lra_release/{RELEASE_SUBDIR}/{sub}/).\n"
                f"Get it from the LRA release archive {common.LRA_RELEASE_URL} "
                f"(tar xzf lra_release.gz; it is lra_release/{RELEASE_SUBDIR}/{sub}/).\n"
                "Or use the offline generator: --source=generated."
            )
        meta_dir = os.path.join(base, "metadata")
        files = sorted(f for f in os.listdir(meta_dir) if f.endswith(".npy"))
        if not files:
            raise common.MissingFilesError(f"{meta_dir} contains no metadata/*.npy files")
        rows = []
        for name in files:
            path = os.path.join(meta_dir, name)
            with open(path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").split("\n")
            for number, text in enumerate(lines, start=1):
                fields = text.split()
                if not fields:
                    continue
                if len(fields) < 4:
                    raise common.MalformedFileError(
                        path, number, f"expected >= 4 space-separated fields, got {len(fields)}"
                    )
                label = common.parse_label(fields[3].encode(), 2, path, number, "label (field 4)")
                image = os.path.join(base, fields[0], fields[1])
                rows.append((path, number, image, label))
        return rows

    def _release_examples(self, rows):
        sub = DIFFICULTY_DIRS[self.builder_config.difficulty]
        for meta_path, number, image_path, label in rows:
            rel = os.path.relpath(image_path, os.path.dirname(os.path.dirname(meta_path)))
            try:
                with Image.open(image_path) as img:
                    mode = img.mode
                    pixels = np.asarray(img, dtype=np.uint8) if mode == "L" else None
            except (OSError, ValueError) as e:
                if f"{sub}/{rel}" in KNOWN_BROKEN_RELEASE_FILES:
                    logging.warning("Skipping known-broken release image %s", image_path)
                    continue
                raise common.MalformedFileError(
                    meta_path, number, f"cannot read image {image_path}: {e}"
                ) from None
            if pixels is None:
                # Converting would silently change the data (RGB -> grey weights, alpha,
                # palettes); the release images are 8-bit grey.
                raise common.MalformedFileError(
                    meta_path,
                    number,
                    f"image {image_path} is {mode!r}, not 8-bit greyscale ('L'); convert "
                    "it deliberately or remove it",
                )
            if pixels.shape != (32, 32):
                raise common.MalformedFileError(
                    meta_path, number, f"image {image_path} is {pixels.shape}, expected (32, 32)"
                )
            yield (
                f"{os.path.basename(meta_path)}:{number}",
                {
                    "inputs": pixels.reshape(1024),
                    "targets": label,
                },
            )
