"""LRA Listops: `get_config("<mechanism>[,paper|reduced|smoke][,lambda=X][,seed=N]")`.

Every field is set and commented in `configs/lra/common.py`; this file adds only what
is specific to Listops.

  python scripts/train.py --config=configs/lra/listops.py:sbm
  python scripts/train.py --config=configs/lra/listops.py:full,smoke
"""

from __future__ import annotations

import ml_collections

from configs.lra import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The Listops config for the preset string `arg` (see configs/lra/common.py)."""
    preset = common.parse(arg)
    config = common.base_config("listops", preset)
    if preset.scale == "paper":
        config.task.source = "generated"  # our generator (lra.prepare's default listops data)
        config.task.generate = ml_collections.ConfigDict(
            {"num_train": 96_000, "num_validation": 2_000, "num_test": 2_000}  # as LRA
        )
    elif preset.scale == "reduced":
        config.task.source = "generated"  # CPU scale: 4,000 / 500 / 500, 128 < length < 512
        config.task.generate = ml_collections.ConfigDict(
            {
                "num_train": 4_000,
                "num_validation": 500,
                "num_test": 500,
                "min_length": 128,
                "max_length": 512,
            }
        )
    elif preset.scale == "smoke":
        config.task.source = "generated"  # a few dozen short expressions, made in < 1 s
        config.task.generate = ml_collections.ConfigDict(
            {
                "num_train": 64,
                "num_validation": 16,
                "num_test": 16,
                "min_length": 8,
                "max_length": 32,
            }
        )
    return config
