"""TFDS builders for the five LRA tasks (importing this module registers them)."""

from __future__ import annotations

import os
from typing import Any

import tensorflow_datasets as tfds

from lra.builders import listops, pathfinder, retrieval, text
from lra.builders.common import LRA_RELEASE_URL, MalformedFileError, MissingFilesError
from lra.builders.image import LraImage
from lra.builders.listops import LraListops
from lra.builders.pathfinder import LraPathfinder
from lra.builders.retrieval import LraRetrieval
from lra.builders.text import LraText

BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    "listops": LraListops,
    "text": LraText,
    "retrieval": LraRetrieval,
    "image": LraImage,
    "pathfinder": LraPathfinder,
}


def make_config(task: str, **options: Any) -> tfds.core.BuilderConfig | None:
    """The builder config of `task` for `options` (None for Image, which has one setup).

    Options: listops: source, num_train, num_validation, num_test, min_length,
    max_length, seed.  pathfinder: source, difficulty, num_train, num_validation,
    num_test, seed.  text / retrieval: max_length.
    """
    makers = {
        "listops": listops.make_config,
        "text": text.make_config,
        "retrieval": retrieval.make_config,
        "pathfinder": pathfinder.make_config,
    }
    if task == "image":
        if options:
            raise ValueError(f"task 'image' takes no options, got {sorted(options)}")
        return None
    if task not in makers:
        raise ValueError(f"unknown LRA task {task!r}; choose from {sorted(BUILDERS)}")
    return makers[task](**options)


def make_builder(
    task: str, config: tfds.core.BuilderConfig | None = None, **kwargs: Any
) -> tfds.core.GeneratorBasedBuilder:
    """The builder of `task` for `config` (from `make_config`); kwargs go to the builder
    (data_dir, and catalog_data_dir for text / image, num_workers for pathfinder)."""
    cls = BUILDERS[task] if task in BUILDERS else None
    if cls is None:
        raise ValueError(f"unknown LRA task {task!r}; choose from {sorted(BUILDERS)}")
    for name in ("data_dir", "catalog_data_dir"):
        # "--data_dir=~/x": the shell leaves ~ after "=" alone, TFDS expands it in some
        # places and not others; expanded here, the dataset lands where it is looked for.
        if kwargs.get(name):
            kwargs[name] = os.path.expanduser(os.fspath(kwargs[name]))
    if config is not None:
        # TFDS wants predefined configs by name, custom ones as objects.
        predefined = {c.name: c for c in cls.BUILDER_CONFIGS}
        if config.name in predefined:
            if predefined[config.name] != config:
                raise ValueError(
                    f"config {config.name!r} differs from the predefined config of that name"
                )
            kwargs["config"] = config.name
        else:
            kwargs["config"] = config
    return cls(**kwargs)


__all__ = [
    "make_builder",
    "BUILDERS",
    "LRA_RELEASE_URL",
    "LraImage",
    "LraListops",
    "LraPathfinder",
    "LraRetrieval",
    "LraText",
    "MalformedFileError",
    "MissingFilesError",
    "make_config",
]
