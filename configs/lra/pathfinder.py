"""LRA Pathfinder: `get_config("<mechanism>[,paper|reduced|smoke][,lambda=X][,seed=N]")`.

Every field is set and commented in `configs/lra/common.py`; this file adds only what
is specific to Pathfinder.

  python scripts/train.py --config=configs/lra/pathfinder.py:sbm
  python scripts/train.py --config=configs/lra/pathfinder.py:full,smoke
"""

from __future__ import annotations

import ml_collections

from configs.lra import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The Pathfinder config for the preset string `arg` (see configs/lra/common.py)."""
    preset = common.parse(arg)
    config = common.base_config("pathfinder", preset)
    config.task.source = "generated"  # our generator (lra.prepare's default pathfinder data)
    config.task.generate = ml_collections.ConfigDict({"difficulty": "hard"})  # 160k/20k/20k
    if preset.scale == "reduced":
        config.task.generate.update({"num_train": 4_000, "num_validation": 500, "num_test": 500})
    elif preset.scale == "smoke":
        # easy contours draw ~3x faster than hard ones: 48 images take a couple of seconds
        config.task.generate = ml_collections.ConfigDict(
            {"difficulty": "easy", "num_train": 32, "num_validation": 8, "num_test": 8}
        )
    return config
