"""Command line of GLUE fine-tuning (see ``glue.finetune_lib``).

  python -m glue.finetune --config=configs/glue/finetune.py:sbm,task=sst2 \
      --init_checkpoint=runs/pretrain_sbm [--data_dir=~/tensorflow_datasets]

Output directory: config.json, metrics.jsonl, metrics.csv, summary.json (accuracy, F1
and macro-F1 per validation split, and the Table 4 headline value).
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from glue.finetune_lib import run_finetuning

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/glue/finetune.py:preset).", lock_config=True
)
_INIT = flags.DEFINE_string(
    "init_checkpoint", None, "Pretraining output directory (or its checkpoints/ folder)."
)
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "tokenizer.json (default: the one beside the checkpoint)."
)
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory holding glue/.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Output directory (default: config.output_dir or runs/<name>-<time>)."
)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/glue/finetune.py:sbm")
    if not _INIT.value:
        raise app.UsageError("--init_checkpoint is required (a glue.pretrain output directory)")
    if _TOKENIZER.value is not None:
        config.data.tokenizer = _TOKENIZER.value
    if _DATA_DIR.value is not None:
        config.data.tfds_data_dir = _DATA_DIR.value
    summary = run_finetuning(config, _INIT.value, _OUTPUT_DIR.value)
    parts = [
        f"{name}: acc {m['accuracy']:.4f} f1 {m['f1']:.4f} macro-f1 {m['macro_f1']:.4f}"
        for name, m in summary["splits"].items()
    ]
    print(
        f"{summary['task']} ({summary['mechanism']}) {summary['metric']} "
        f"{summary['headline']:.4f} | " + " | ".join(parts) + f" -> {summary['output_dir']}",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main)
