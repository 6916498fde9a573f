"""Shared pieces of ``configs/glue/{pretrain,finetune}.py``: their preset words and the
model section (the paper's small BERT, appendix C). The parser and each mechanism's
options are the ones every config uses (``configs/presets.py``).

Presets after the colon, combined with commas:
  mechanism: sbm (default: k=128, window 64), sbm_nowindow, full, reformer, performer,
             linformer, nystromformer, local
  size:      paper (default) or smoke (tiny; its attention sizes are the table's
             ``glue_smoke`` scale)
  task=NAME: the task to fine-tune (finetune.py only)
"""

from __future__ import annotations

import ml_collections

from configs import presets

# Table 4 rows, plus sbm without the window and plain local attention for ablations.
MECHANISMS = (
    "full",
    "reformer",
    "performer",
    "linformer",
    "nystromformer",
    "sbm",
    "sbm_nowindow",
    "local",
)
SIZES = ("paper", "smoke")  # the first: the default
SCALE = {"paper": "paper", "smoke": "glue_smoke"}  # -> presets.SCALES
# The SBM options the GLUE configs set: the paper's GLUE model unions a local window.
SBM_FIELDS = ("num_clusters", "delta", "edge_law", "self_loops", "window", "impl", "ste")


def parse(arg: str | None, allow_task: bool) -> presets.Preset:
    """``"sbm,smoke,task=sst2"`` -> Preset("sbm", "smoke", task="sst2"); defaults sbm, paper."""
    keys = ("task",) if allow_task else ()
    return presets.parse_preset(arg, mechanisms=MECHANISMS, scales=SIZES, keys=keys)


def model_config(
    mechanism: str, size: str, pooling: str, num_classes: int
) -> ml_collections.ConfigDict:
    """The ``model`` section: the paper's small BERT (appendix C, table 7) or a tiny one.

    Fine-tuning replaces the architecture fields with the pretraining checkpoint's.
    """
    smoke = size == "smoke"
    model = ml_collections.ConfigDict()
    model.vocab_size = 300 if smoke else 50265  # tokens incl. 5 specials (paper: 50,265)
    model.max_len = 32 if smoke else 512  # position table length (paper: 512)
    model.emb_dim = 16 if smoke else 512  # model width (paper: 512)
    model.num_layers = 2 if smoke else 4  # encoder blocks (paper: 4)
    model.num_heads = 2 if smoke else 8  # attention heads (paper: 8)
    model.head_dim = 8 if smoke else 64  # width per head; heads * head_dim == emb_dim
    model.mlp_dim = 32 if smoke else 2048  # MLP hidden width (paper: 2048)
    model.dropout = 0.1  # dropout after embeddings, attention and MLP (paper: 0.1)
    model.attention_dropout = 0.1  # dropout on attention weights (paper: 0.1)
    model.pooling = pooling  # "none" for MLM, "mean" for fine-tuning (paper: mean)
    model.classifier_dim = 16 if smoke else 512  # hidden width of the classification head
    model.num_classes = num_classes  # MLM: vocab size; GLUE: 2 (MNLI 3)
    model.token_head_dim = 16 if smoke else 512  # MLM head transform width (0: one Dense)
    model.dtype = "float32"  # compute dtype: float32, bfloat16 (float16: no loss scaling)
    model.remat = False  # recompute each block in the backward pass (saves memory)
    # Sparse Transformer init: attention out and MLP fc2 kernels x 1/sqrt(2 * num_layers)
    model.scaled_residual_init = False
    model.attention = presets.registry_name(mechanism)  # registry name of the mechanism
    fields = SBM_FIELDS if model.attention == "sbm" else None
    # That mechanism's own options (configs/presets.py: OPTIONS at this size's scale).
    model.attention_options = presets.attention_options(
        mechanism, SCALE[size], model.max_len, fields=fields
    )
    return model
