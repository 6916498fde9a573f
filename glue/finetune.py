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

from sbm_jax.training import cli

#: This command's own flags and the config field each sets; every other flag is the
#: trainer's.
ALIASES = {
    "init_checkpoint": "init_from",
    "tokenizer": "data.tokenizer",
    "data_dir": "data.tfds_data_dir",
}


def main(argv: list[str] | None = None) -> int:
    return cli.main(
        list(sys.argv if argv is None else argv), task_modules=("glue.tasks",), aliases=ALIASES
    )


if __name__ == "__main__":
    cli.run(task_modules=("glue.tasks",), aliases=ALIASES)
