"""Train a model on the task its config names, through the one trainer.

  python scripts/train.py --config=configs/synthetic.py:quick
  python scripts/train.py --config=configs/lra/listops.py:sbm,smoke --config.seed=1
  python scripts/train.py --config=configs/glue/pretrain.py:sbm,smoke \
      --config.data.corpus='docs/*.md'
  python scripts/train.py --config=configs/synthetic.py:sbm --print_config   # list the fields

Writes config.json, metrics.jsonl, metrics.csv (step, loss, accuracy, density),
metrics.png, TensorBoard events, checkpoints/{latest,best}/ and summary.json into the
output directory (default runs/<config.name>-<timestamp>; an existing run in
--output_dir is resumed if its config matches) and prints a one-line summary. See
``sbm_jax/training/cli.py`` for the order of the checks and the exit statuses (2: a user
error, printed as one line; 3: a non-finite step; 74: no space left under the run's
folder; 75: stopped by a signal after saving, resumable).
"""

from __future__ import annotations

import os
import sys

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sbm_jax.training import cli  # noqa: E402

# Task packages outside the library register their tasks when imported.
TASK_MODULES = cli.DEFAULT_TASK_MODULES


def main(argv: list[str] | None = None) -> int:
    """The exit status of one run of the command line ``argv`` (program name first)."""
    return cli.main(list(sys.argv if argv is None else argv), task_modules=TASK_MODULES)


if __name__ == "__main__":
    cli.run(task_modules=TASK_MODULES)
