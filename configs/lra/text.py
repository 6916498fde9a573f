"""LRA Text: `get_config("<mechanism>[,paper|reduced|smoke][,lambda=X][,seed=N]")`.

Every field is set and commented in `configs/lra/common.py`; this file adds only what
is specific to Text.

  python scripts/train.py --config=configs/lra/text.py:sbm
  python scripts/train.py --config=configs/lra/text.py:full,smoke
"""

from __future__ import annotations

import ml_collections

from configs.lra import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The Text config for the preset string `arg` (see configs/lra/common.py)."""
    preset = common.parse(arg)
    config = common.base_config("text", preset)
    if preset.scale != "smoke":
        # lra.prepare --task=text builds bytes3072 (the paper's 3072); shorter cuts read it too
        config.task.data_config = "bytes3072"
    return config
