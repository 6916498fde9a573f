"""Shared pieces of ``configs/glue/{pretrain,finetune}.py``: preset parsing, the model
section (the paper's small BERT) and each mechanism's options (paper appendix C)."""

from __future__ import annotations

import ml_collections

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
SIZES = ("paper", "smoke")


def parse_preset(arg: str | None, allow_task: bool) -> tuple[str, str, str | None]:
    """``"sbm,smoke,task=sst2"`` -> ("sbm", "smoke", "sst2"); defaults sbm, paper, None."""
    mechanism, size, task = "sbm", "paper", None
    for part in (arg or "").replace(" ", "").split(","):
        if not part:
            continue
        if part in MECHANISMS:
            mechanism = part
        elif part in SIZES:
            size = part
        elif allow_task and part.startswith("task="):
            task = part.split("=", 1)[1]
        else:
            extra = ", task=<name>" if allow_task else ""
            raise ValueError(
                f"unknown preset {part!r} in {arg!r}; mechanisms {MECHANISMS}, sizes {SIZES}{extra}"
            )
    return mechanism, size, task


def attention_options(mechanism: str, size: str) -> tuple[str, ml_collections.ConfigDict]:
    """(registry name, ``model.attention_options``) of a mechanism preset."""
    options = ml_collections.ConfigDict()
    smoke = size == "smoke"
    if mechanism in ("sbm", "sbm_nowindow"):
        options.num_clusters = 4 if smoke else 128  # k, clusters per head (paper: 128)
        options.delta = 0.01  # exploration probability added to every pair (training only)
        options.edge_law = "bernoulli"  # "bernoulli" (the paper's SBM) or "poisson" (fastRG)
        options.self_loops = False  # add (i, i) for every real token (paper: off)
        # Local window unioned with the sampled graph, |i - j| <= window // 2 (paper: 64).
        options.window = 0 if mechanism == "sbm_nowindow" else (4 if smoke else 64)
        options.impl = "dense" if smoke else "auto"  # "auto", "sparse" or "dense" path
        options.ste = "paper"  # mask estimator: "paper" (eq. 9) or "reference" (released code)
        return "sbm", options
    if mechanism == "local":
        options.window = 4 if smoke else 64  # |i - j| <= window // 2
        return "local", options
    if mechanism == "reformer":
        options.num_hashes = 2  # hashing rounds (paper: 2)
        options.chunk_len = 8 if smoke else 64  # LSH chunk length
        return "reformer", options
    if mechanism == "performer":
        options.num_features = 8 if smoke else 256  # random features (paper: 256)
        return "performer", options
    if mechanism == "linformer":
        options.proj_len = 8 if smoke else 256  # projected length (paper: 256)
        options.max_len = 32 if smoke else 512  # longest sequence the projection covers
        return "linformer", options
    if mechanism == "nystromformer":
        options.num_landmarks = 4 if smoke else 256  # landmarks (paper: 256)
        options.conv_kernel_size = 3 if smoke else 35  # depthwise conv on V (0: off)
        return "nystromformer", options
    if mechanism == "full":
        return "full", options  # softmax attention has no options
    raise ValueError(f"unknown mechanism {mechanism!r}; choose one of {MECHANISMS}")


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
    model.dtype = "float32"  # compute dtype: float32 or bfloat16
    name, options = attention_options(mechanism, size)
    model.attention = name  # registry name of the attention mechanism
    model.attention_options = options  # that mechanism's own options
    return model
