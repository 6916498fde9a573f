"""ListOps (10 classes, <= 2000 tokens): generated offline or read from the release TSVs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow_datasets as tfds

from lra import listops_generator, vocab
from lra.builders import common

RELEASE_FILES = {
    "train": "basic_train.tsv",
    "validation": "basic_val.tsv",
    "test": "basic_test.tsv",
}
RELEASE_SUBDIR = "listops-1000"


@dataclasses.dataclass
class ListOpsConfig(tfds.core.BuilderConfig):
    """source='generated' (our generator, these sizes) or 'release' (official TSVs)."""

    source: str = "generated"
    num_train: int = 96_000
    num_validation: int = 2_000
    num_test: int = 2_000
    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    seed: int = 0

    def generator_params(self) -> listops_generator.ListOpsParams:
        return listops_generator.ListOpsParams(
            min_length=self.min_length,
            max_length=self.max_length,
            max_depth=self.max_depth,
            max_args=self.max_args,
        )


def make_config(
    source: str = "generated",
    *,
    num_train: int = 96_000,
    num_validation: int = 2_000,
    num_test: int = 2_000,
    min_length: int = 500,
    max_length: int = 2000,
    seed: int = 0,
) -> ListOpsConfig:
    """A config whose name encodes every non-default setting (so datasets never collide)."""
    if source == "release":
        return ListOpsConfig(name="release", source="release", description="LRA release TSVs")
    if source != "generated":
        raise ValueError(f"ListOps source must be 'generated' or 'release', got {source!r}")
    params = listops_generator.ListOpsParams(min_length=min_length, max_length=max_length)
    sizes = (num_train, num_validation, num_test)
    if min(sizes) < 0 or max(sizes) == 0:
        raise ValueError(f"ListOps split sizes must be >= 0 and not all 0, got {sizes}")
    listops_generator.check_sizes(
        params, {"train": num_train, "validation": num_validation, "test": num_test}
    )
    name = "generated"
    if sizes != (96_000, 2_000, 2_000):
        name += f"_n{num_train}-{num_validation}-{num_test}"
    if (min_length, max_length) != (500, 2000):
        name += f"_len{min_length}-{max_length}"
    if seed != 0:
        name += f"_seed{seed}"
    return ListOpsConfig(
        name=name,
        source="generated",
        num_train=num_train,
        num_validation=num_validation,
        num_test=num_test,
        min_length=min_length,
        max_length=max_length,
        seed=seed,
        description=(
            f"generated: {num_train}/{num_validation}/{num_test} examples, "
            f"{min_length} < length < {max_length}, seed {seed}"
        ),
    )


class LraListops(tfds.core.GeneratorBasedBuilder):
    """LRA ListOps as token ids (vocabulary in `lra.vocab`, round brackets dropped)."""

    VERSION = tfds.core.Version("1.0.0")
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Only for config 'release': put basic_train.tsv, basic_val.tsv and basic_test.tsv "
        f"(lra_release/{RELEASE_SUBDIR}/ in {common.LRA_RELEASE_URL}) in the manual dir."
    )
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        make_config("generated"),
        make_config("release"),
        make_config(
            num_train=2000, num_validation=200, num_test=200, min_length=128, max_length=512
        ),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "inputs": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "targets": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("inputs", "targets"),
            homepage="https://github.com/google-research/long-range-arena",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        cfg = self.builder_config
        if cfg.source == "release":
            paths = common.locate_release_files(
                "listops",
                common.manual_dir_of(dl_manager),
                list(RELEASE_FILES.values()),
                RELEASE_SUBDIR,
            )
            return {
                split: self._generate_examples(split=split, path=paths[name])
                for split, name in RELEASE_FILES.items()
            }
        sizes = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}
        # A split of size 0 is left out (TFDS cannot write empty splits).
        return {split: self._generate_examples(split=split) for split, n in sizes.items() if n}

    def _generate_examples(self, split: str, path: str | None = None):
        """Release: the rows of `path`.  Generated: `num_<split>` fresh expressions."""
        cfg = self.builder_config
        if path is not None:
            yield from common.require_examples(self._release_examples(path), path)
            return
        sizes = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}
        params = cfg.generator_params()
        # No expression in two splits: each split redraws the ones of the splits before
        # it. TFDS writes the splits in order, so their digests are at hand by then.
        cache = self.__dict__.setdefault("_split_digests", {})
        exclude = listops_generator.earlier_digests(
            params, seed=cfg.seed, sizes=sizes, split=split, cache=cache
        )
        mine = []
        for index, ids, label in listops_generator.generate_split(
            params, seed=cfg.seed, split=split, num_examples=sizes[split], exclude=exclude
        ):
            mine.append(listops_generator.expression_digest(ids))
            yield index, {"inputs": ids, "targets": label}
        cache[split] = frozenset(mine)

    def _release_examples(self, path: str):
        for line, (source, target) in common.iter_tsv(path, 2, header=("Source", "Target")):
            text = source.decode("utf-8", "replace").strip()
            if not text:
                raise common.MalformedFileError(path, line, "empty Source")
            try:
                ids = vocab.encode_listops(text)
                vocab.check_listops_expression(text)
            except ValueError as e:
                raise common.MalformedFileError(path, line, str(e)) from None
            if ids.size == 0:
                raise common.MalformedFileError(path, line, "Source has no tokens")
            label = common.parse_label(target, 10, path, line, "Target")
            value = listops_generator.evaluate(ids)
            if label != value:
                # A shifted or hand-edited file: trained on, it would teach noise.
                raise common.MalformedFileError(
                    path, line, f"Target {label} is not the value of its Source, {value}"
                )
            yield f"{os.path.basename(path)}:{line}", {"inputs": ids, "targets": label}
