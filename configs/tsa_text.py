"""The Tensorized Spectral Attention paper's seven-layer text classifier (a model config).

Embedding -> TSA (H=2, tensor-train projections) -> average pooling -> dropout ->
dense 20 relu -> dropout -> softmax, on the LRA Text task (byte-level IMDB). The paper
classifies word tokens (20,000 most common words, 200 tokens); here the tokens are the
task's bytes, so only the vocabulary differs.

  python scripts/train.py --config=configs/tsa_text.py            # LRA Text, paper length
  python scripts/train.py --config=configs/tsa_text.py:reduced    # shorter, for CPU runs
  python scripts/train.py --config=configs/tsa_text.py:smoke      # seconds, random data
"""

from __future__ import annotations

import ml_collections

from configs import presets
from configs.lra import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """``arg`` = "[paper|reduced|smoke][,seed=N]" (the LRA presets; the mechanism is TSA)."""
    preset = presets.parse_preset(
        arg,
        mechanisms=("tsa",),
        scales=common.SCALES,
        keys=("lambda", "seed"),
        default_mechanism="tsa",
    )
    config = common.base_config("text", preset)
    common.set_run_name(config, "tsa_text", preset)
    model = config.model
    model.architecture = "tsa_classifier"  # the TSA paper's classifier, not the encoder
    # encoder fields the classifier does not read (the config check refuses them)
    del model["remat"], model["scaled_residual_init"], model["mlp_dim"], model["pooling"]
    model.num_layers = 1  # one TSA layer (counted as one attention layer in FLOPs)
    model.emb_dim = 16  # embedding size I (a power of two gives the QTT setting, I_n = 2)
    model.num_heads = 2  # TSA heads (TSA paper: H = 2)
    model.head_dim = 8  # per-head key/value width; num_heads * head_dim == emb_dim
    model.classifier_dim = 20  # units of the relu dense layer (TSA paper: 20)
    model.dropout = 0.1  # both dropout layers (TSA paper: 0.1)
    model.attention_dropout = 0.0  # dropout on Psi's entries (docs/tsa.md item 10): off
    # TSA's options, the TSA paper's values (configs/presets.py: OPTIONS["tsa"]).
    model.attention_options = presets.attention_options(
        "tsa", preset.scale, model.max_len, fields=("damping", "projection", "tt_rank")
    )
    return config
