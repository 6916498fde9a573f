"""GLUE fine-tuning (paper section 5.3) from an MLM pretraining checkpoint.

Presets after the colon, combined with commas:
  mechanism: sbm (default), sbm_nowindow, full, reformer, performer, linformer,
             nystromformer, local (must match the checkpoint's; the architecture fields
             of ``model`` are taken from the checkpoint)
  size:      paper (default: batch 32, lr 3e-5, 5 epochs, length 512) or smoke (tiny)
  task=NAME: sst2 (default), qqp, mnli, qnli

  python scripts/train.py --config=configs/glue/finetune.py:sbm,task=mnli \
      --config.init_from=runs/pretrain_sbm
"""

from __future__ import annotations

import ml_collections

from configs import base
from configs.glue.common import model_config, parse
from glue.data import get_task_spec


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Config for ``arg`` = "[mechanism][,paper|smoke][,task=NAME]"."""
    preset = parse(arg, allow_task=True)
    mechanism, size, task = preset.mechanism, preset.scale, preset.task or "sst2"
    spec = get_task_spec(task)
    smoke = size == "smoke"
    config = ml_collections.ConfigDict()
    config.name = f"glue_{task}_{mechanism}" + ("_smoke" if smoke else "")  # run name
    config.seed = 0  # seeds the head, graph sampling, dropout and shuffling
    config.output_dir = ""  # "" -> runs/<name>-<timestamp>; --output_dir overrides
    # The pretraining run (or one of its checkpoints: .../checkpoints/best/<step>) whose
    # encoder, model config and tokenizer start the fine-tuning (its best checkpoint).
    config.init_from = ""
    config.mechanism = mechanism  # preset name, the row label of the Table 4 report

    config.task = ml_collections.ConfigDict()
    config.task.name = f"glue_{task}"  # task registry name: glue_sst2, _qqp, _mnli, _qnli

    config.data = ml_collections.ConfigDict()
    config.data.max_len = 32 if smoke else 512  # padded example length (paper: 512)
    # Cut pairs longer than max_len longest-first (BERT practice; the count is printed).
    # False: such examples are an error naming the split.
    config.data.truncate = True
    # Let TFDS download and prepare missing data (needs network; off for smoke runs).
    # Offline: prepare once with `python -m glue.prepare --tasks=...`, then train.
    config.data.tfds_download = not smoke
    config.data.tfds_data_dir = ""  # TFDS data directory ("" = TFDS default)
    config.data.tokenizer = ""  # "" = the tokenizer.json beside init_from's run (or a copy)
    config.data.max_train_examples = 0  # use only the first N training examples (0: all)
    # Use only the first N examples per validation split (0: all); the unlabelled test
    # splits are always predicted in full (predictions/ must cover every example).
    config.data.max_eval_examples = 0

    config.model = model_config(mechanism, size, pooling="mean", num_classes=spec.num_classes)

    config.train = base.train_section(
        batch_size=4 if smoke else 32,  # examples per step (paper: 32)
        eval_batch_size=4 if smoke else 128,  # examples per evaluation batch
        num_epochs=0.0 if smoke else 5.0,  # passes over the train split (paper: 5); 0: num_steps
        num_steps=3 if smoke else 1,  # optimizer steps when num_epochs is 0 (else derived)
        learning_rate=1e-3 if smoke else 3e-5,  # peak learning rate (paper: 3e-5)
        warmup_fraction=0.06,  # warm-up share of the steps (not in the paper)
        warmup_steps=0,  # derived from warmup_fraction at start-up
        end_learning_rate_factor=0.0,  # linear decay to 0
        weight_decay=0.01,  # AdamW decoupled weight decay
        # decay kernels and embeddings, not biases or LayerNorm scales (BERT's optimizer)
        weight_decay_mask="matrices",
        b2=0.98,
        eps=1e-8,  # Adam epsilon (optax's default)
        grad_clip_norm=1.0,
        log_every=1 if smoke else 50,
        eval_every=0 if smoke else 1000,
    )
    # the task's dev metric (f1 / macro_f1 / accuracy) picks the best checkpoint
    config.checkpoint = base.checkpoint_section(best_metric=spec.metric, best_mode="max")
    config.mesh = base.mesh_section()
    return config
