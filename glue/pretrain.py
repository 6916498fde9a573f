"""Alias of ``scripts/train.py`` for MLM pretraining, keeping the older flags.

  python -m glue.pretrain --config=configs/glue/pretrain.py:sbm,smoke --corpus='docs/*.md'

is ``python scripts/train.py --config=configs/glue/pretrain.py:sbm,smoke
--config.data.corpus='docs/*.md'``: ``--corpus`` sets ``config.data.corpus`` and
``--tokenizer`` sets ``config.data.tokenizer``; every other flag is the trainer's.
"""

from __future__ import annotations

import sys
from typing import Any

from absl import flags

from sbm_jax.training import cli


def define_extra(fv: Any) -> None:
    flags.DEFINE_string(
        "corpus", None, "Sets config.data.corpus (a glob of text files).", flag_values=fv
    )
    flags.DEFINE_string("tokenizer", None, "Sets config.data.tokenizer.", flag_values=fv)


def adjust(config: Any, fv: Any) -> None:
    if fv.corpus is not None:
        config.data.corpus = fv.corpus
    if fv.tokenizer is not None:
        config.data.tokenizer = fv.tokenizer


def main(argv: list[str] | None = None) -> int:
    return cli.main(
        list(sys.argv if argv is None else argv),
        task_modules=("glue.tasks",),
        adjust=adjust,
        define_extra=define_extra,
    )


if __name__ == "__main__":
    cli.run(task_modules=("glue.tasks",), adjust=adjust, define_extra=define_extra)
