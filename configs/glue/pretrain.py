"""MLM pretraining of the paper's small BERT (section 5.3, appendix C) for GLUE.

Presets after the colon, combined with commas:
  mechanism: sbm (default: k=128, no regulariser, window 64), sbm_nowindow, full,
             reformer, performer, linformer, nystromformer, local
  size:      paper (default: batch 256, lr 1e-4, 50 epochs, length 512) or smoke (tiny)

  python scripts/train.py --config=configs/glue/pretrain.py:sbm \
      --config.data.corpus='text/*.txt' --output_dir=runs/pretrain_sbm
  python scripts/train.py --config=configs/glue/pretrain.py:full,smoke \
      --config.data.corpus='docs/*.md'
"""

from __future__ import annotations

import ml_collections

from configs import base
from configs.glue.common import model_config, parse


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Config for ``arg`` = "[mechanism][,paper|smoke]"."""
    preset = parse(arg, allow_task=False)
    mechanism, size = preset.mechanism, preset.scale
    smoke = size == "smoke"
    config = ml_collections.ConfigDict()
    config.name = f"glue_pretrain_{mechanism}" + ("_smoke" if smoke else "")  # run name
    config.seed = 0  # seeds parameters, graph sampling, dropout, shuffling and masking
    config.output_dir = ""  # "" -> runs/<name>-<timestamp>; --output_dir overrides
    config.init_from = ""  # "" or a run / checkpoint whose parameters start this one

    config.task = ml_collections.ConfigDict()
    config.task.name = "glue_mlm"  # task registry name (masked language modelling)

    config.data = ml_collections.ConfigDict()
    config.data.corpus = ""  # glob(s) of local text files (comma-separated globs allowed)
    config.data.tfds_name = (
        ""  # TFDS text builder used when corpus is "" (e.g. wikipedia/20230601.en)
    )
    config.data.tfds_split = "train"  # split of that builder
    config.data.tfds_text_key = "text"  # feature holding the document text
    # Let TFDS download and prepare missing data (needs network; off for smoke runs).
    config.data.tfds_download = not smoke
    config.data.tfds_data_dir = ""  # TFDS data directory ("" = TFDS default)
    config.data.max_documents = 0  # read at most this many documents (0: all)
    config.data.tokenizer = ""  # existing tokenizer.json to load ("" = train one)
    config.data.tokenizer_min_frequency = 2  # BPE: a pair must occur this often to merge
    config.data.max_len = 32 if smoke else 512  # packed sequence length (paper: 512)
    config.data.mask_rate = 0.15  # fraction of ordinary tokens selected (BERT: 0.15)
    config.data.mask_token_rate = 0.8  # selected -> <mask> (BERT: 0.8)
    config.data.random_token_rate = 0.1  # selected -> random token (BERT: 0.1; rest unchanged)
    # Scored positions per sequence; rows selecting more keep a random subset. 128 at
    # length 512 is 6 standard deviations above the binomial mean (76.6), so it never binds.
    config.data.max_predictions = 32 if smoke else 128
    config.data.eval_fraction = 0.01  # share of packed sequences held out for MLM eval
    config.data.eval_sequences_max = 8 if smoke else 2048  # cap on held-out sequences

    config.model = model_config(mechanism, size, pooling="none", num_classes=0)
    config.model.num_classes = config.model.get_ref("vocab_size")  # MLM: one class per token

    config.train = base.train_section(
        batch_size=8 if smoke else 256,  # sequences per step (paper: 256)
        num_epochs=0.0 if smoke else 50.0,  # passes over the corpus (paper: 50); 0: num_steps
        num_steps=4 if smoke else 1,  # optimizer steps when num_epochs is 0 (else derived)
        learning_rate=1e-3 if smoke else 1e-4,  # peak learning rate (paper: 1e-4)
        warmup_fraction=0.06,  # warm-up share of the steps (not in the paper; RoBERTa's)
        warmup_steps=0,  # derived from warmup_fraction at start-up
        end_learning_rate_factor=0.0,  # linear decay to 0 (BERT/RoBERTa)
        weight_decay=0.01,  # AdamW decoupled weight decay (BERT: 0.01)
        # decay kernels and embeddings, not biases or LayerNorm scales (BERT's optimizer)
        weight_decay_mask="matrices",
        b2=0.98,  # Adam beta2 (RoBERTa: 0.98)
        eps=1e-8,  # Adam epsilon (optax's default)
        grad_clip_norm=1.0,
        log_every=1 if smoke else 50,
        eval_every=0 if smoke else 2000,  # steps between held-out MLM evals (0: end only)
    )
    # the held-out MLM loss picks the best checkpoint
    config.checkpoint = base.checkpoint_section(best_metric="loss", best_mode="min")
    config.mesh = base.mesh_section()
    return config
