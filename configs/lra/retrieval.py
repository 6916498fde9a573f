"""LRA Retrieval: `get_config("<mechanism>[,paper|reduced|smoke][,lambda=X][,seed=N]")`.

Every field is set and commented in `configs/lra/common.py`; this file adds only what
is specific to Retrieval.

  python scripts/train.py --config=configs/lra/retrieval.py:sbm
  python scripts/train.py --config=configs/lra/retrieval.py:full,smoke
"""

from __future__ import annotations

import ml_collections

from configs.lra import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The Retrieval config for the preset string `arg` (see configs/lra/common.py)."""
    preset = common.parse(arg)
    config = common.base_config("retrieval", preset)
    if preset.scale != "smoke":
        config.task.data_config = "bytes4096"  # lra.prepare --task=retrieval (paper: 4096)
    return config
