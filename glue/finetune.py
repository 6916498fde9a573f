"""Alias of ``scripts/train.py`` for GLUE fine-tuning, keeping the older flags.

  python -m glue.finetune --config=configs/glue/finetune.py:sbm,task=sst2 \
      --init_checkpoint=runs/pretrain_sbm

is ``python scripts/train.py --config=configs/glue/finetune.py:sbm,task=sst2
--config.init_from=runs/pretrain_sbm``: ``--init_checkpoint`` sets ``config.init_from``,
``--tokenizer`` ``config.data.tokenizer`` and ``--data_dir`` ``config.data.tfds_data_dir``;
every other flag is the trainer's.
"""

from __future__ import annotations

import sys
from typing import Any

from absl import flags

from sbm_jax.training import cli


def define_extra(fv: Any) -> None:
    flags.DEFINE_string("init_checkpoint", None, "Sets config.init_from.", flag_values=fv)
    flags.DEFINE_string("tokenizer", None, "Sets config.data.tokenizer.", flag_values=fv)
    flags.DEFINE_string("data_dir", None, "Sets config.data.tfds_data_dir.", flag_values=fv)


def adjust(config: Any, fv: Any) -> None:
    if fv.init_checkpoint is not None:
        config.init_from = fv.init_checkpoint
    if fv.tokenizer is not None:
        config.data.tokenizer = fv.tokenizer
    if fv.data_dir is not None:
        config.data.tfds_data_dir = fv.data_dir


def main(argv: list[str] | None = None) -> int:
    return cli.main(
        list(sys.argv if argv is None else argv),
        task_modules=("glue.tasks",),
        adjust=adjust,
        define_extra=define_extra,
    )


if __name__ == "__main__":
    cli.run(task_modules=("glue.tasks",), adjust=adjust, define_extra=define_extra)
