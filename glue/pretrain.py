"""Alias of ``scripts/train.py`` for MLM pretraining, keeping the older flags.

  python -m glue.pretrain --config=configs/glue/pretrain.py:sbm,smoke --corpus='docs/*.md'

is ``python scripts/train.py --config=configs/glue/pretrain.py:sbm,smoke
--config.data.corpus='docs/*.md'``: ``--corpus`` sets ``config.data.corpus`` and
``--tokenizer`` sets ``config.data.tokenizer``; every other flag is the trainer's.
"""

from __future__ import annotations

import sys

from sbm_jax.training import cli

#: This command's own flags and the config field each sets; every other flag is the
#: trainer's.
ALIASES = {"corpus": "data.corpus", "tokenizer": "data.tokenizer"}


def main(argv: list[str] | None = None) -> int:
    return cli.main(
        list(sys.argv if argv is None else argv), task_modules=("glue.tasks",), aliases=ALIASES
    )


if __name__ == "__main__":
    cli.run(task_modules=("glue.tasks",), aliases=ALIASES)
