"""LRA Image: `get_config("<mechanism>[,paper|reduced|smoke][,lambda=X][,seed=N]")`.

Every field is set and commented in `configs/lra/common.py`; this file adds only what
is specific to Image.

  python scripts/train.py --config=configs/lra/image.py:sbm
  python scripts/train.py --config=configs/lra/image.py:full,smoke
"""

from __future__ import annotations

import ml_collections

from configs.lra import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The Image config for the preset string `arg` (see configs/lra/common.py)."""
    preset = common.parse(arg)
    config = common.base_config("image", preset)
    return config
