"""Command line of MLM pretraining for GLUE (see ``glue.pretrain_lib``).

  python -m glue.pretrain --config=configs/glue/pretrain.py:sbm,smoke --corpus='docs/*.md'
  python -m glue.pretrain --config=configs/glue/pretrain.py:full --corpus='text/*.txt' \
      --output_dir=runs/pretrain_full

Output directory: tokenizer.json, checkpoints/<step>/, config.json, metrics.jsonl,
metrics.csv, metrics.png, summary.json.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from glue.pretrain_lib import run_pretraining

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/glue/pretrain.py:preset).", lock_config=True
)
_CORPUS = flags.DEFINE_string(
    "corpus", None, "Glob of local text files (one document per blank-line-separated block)."
)
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "Existing tokenizer.json to use instead of training one."
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Output directory (default: config.output_dir or runs/<name>-<time>)."
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/glue/pretrain.py:sbm")
    if _CORPUS.value is not None:
        config.data.corpus = _CORPUS.value
    if _TOKENIZER.value is not None:
        config.data.tokenizer = _TOKENIZER.value
    summary = run_pretraining(config, _OUTPUT_DIR.value)
    print(
        f"MLM step {summary['step']} ({summary['attention']}): loss {summary['mlm_loss']:.4f} "
        f"accuracy {summary['mlm_accuracy']:.4f} | eval {summary['eval']} | "
        f"{summary['wall_time_s']:.1f} s -> {summary['checkpoint_dir']}",
        file=sys.stdout,
        flush=True,
    )


if __name__ == "__main__":
    app.run(main)
