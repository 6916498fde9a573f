"""Shared pieces of the five LRA configs (``configs/lra/<task>.py``).

Preset syntax after the colon, comma-separated, in any order:

  mechanism  any registered attention (``sbm``, ``full``, ``performer``, ``linformer``,
             ``nystromformer``, ``reformer``, ``linear``, ``local``, ``sparse_fixed``,
             ``sparse_strided``, ``tsa``); default ``sbm``
  scale      ``paper`` (default: the paper's appendix Table 7), ``reduced`` (paper model,
             shorter sequences and fewer steps: a CPU-sized run), ``smoke`` (tiny, seconds)
  lambda=X   weight of SBM's density regulariser (train.density_lambda), e.g. ``lambda=1e-2``
  seed=N     the run's seed

  python scripts/train.py --config=configs/lra/listops.py:sbm
  python scripts/train.py --config=configs/lra/image.py:sbm,lambda=1e-2 --config.seed=1
  python scripts/train.py --config=configs/lra/listops.py:full,smoke

The parser and each mechanism's options per scale are shared with the other configs
(``configs/presets.py``).

Sources of the ``paper`` numbers: model and optimisation sizes are the SBM-Transformer
appendix Table 7 (layers, heads, widths, sequence length, dropout, pooling, batch size,
learning rate, steps) and its caption (128 clusters, 2 hashes, 256 landmarks / features /
projection). Optimiser details (AdamW, eps 1e-6, no weight decay, linear warm-up then
linear decay) and per-task warm-up and evaluation frequency follow the LRA reference
code the paper builds on (the Nystromformer LRA configs, as copied into the
SBM-Transformer repository's ``code/lra_config.py``, checked value by value: warm-up
1000 / 8000 / 800 / 175 / 312 steps and dev evaluation every 50 / 500 / 300 / 175 / 312
steps for listops / text / retrieval / image / pathfinder); they are listed in
``REFERENCE_TRAINING`` below.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from configs import base, presets
from lra import tasks as lra_tasks

SCALES = ("paper", "reduced", "smoke")  # the LRA presets' scales (the first: the default)


@dataclasses.dataclass(frozen=True)
class PaperTask:
    """Per-task settings of appendix Table 7 plus the reference training schedule."""

    seq_len: int  # padded length per input (Table 7)
    batch_size: int  # global batch (Table 7)
    learning_rate: float  # peak learning rate (Table 7)
    num_steps: int  # training steps (Table 7, "epochs" there means optimizer steps)
    warmup_steps: int  # linear warm-up (reference code)
    eval_every: int  # steps between dev evaluations (reference code)
    reduced_seq_len: int  # sequence length of the ``reduced`` scale


REFERENCE_TRAINING: dict[str, PaperTask] = {
    "listops": PaperTask(2048, 128, 5e-4, 5_000, 1_000, 50, 512),
    "text": PaperTask(3072, 128, 5e-4, 20_000, 8_000, 500, 1024),
    "retrieval": PaperTask(4096, 32, 1e-4, 30_000, 800, 300, 1024),
    "image": PaperTask(1024, 1024, 5e-4, 35_000, 175, 175, 1024),
    "pathfinder": PaperTask(1024, 1024, 5e-4, 62_400, 312, 312, 1024),
}


def parse(arg: str | None) -> presets.Preset:
    """``"sbm,smoke,lambda=1e-2,seed=1"`` -> Preset(mechanism, scale, lam, seed).

    Raises:
      ValueError naming the bad part and the valid choices.
    """
    from sbm_jax.attention import available

    return presets.parse_preset(arg, mechanisms=available(), scales=SCALES, keys=("lambda", "seed"))


def set_run_name(config: ml_collections.ConfigDict, stem: str, preset: presets.Preset) -> None:
    """``config.name = "<stem>[_lambda<lam>][_<scale>]_seed<config.seed>"``, following
    later changes of the seed.

    The name is a reference to ``config.seed``, so ``--config.seed=1`` on a preset
    without ``seed=`` names the run ``..._seed1``, as ``seed=1`` in the preset would. An
    explicit ``--config.name`` still wins.
    """
    suffix = "" if preset.scale == "paper" else f"_{preset.scale}"
    lam_text = f"_lambda{preset.lam:g}" if preset.lam else ""
    prefix = ml_collections.FieldReference(f"{stem}{lam_text}{suffix}_seed")
    config.name = prefix + config.get_ref("seed").to_str()  # run name


def base_config(task: str, preset: presets.Preset) -> ml_collections.ConfigDict:
    """The full config of LRA ``task`` for ``preset`` (``parse(arg)``)."""
    mechanism, scale, lam, seed = preset.mechanism, preset.scale, preset.lam, preset.seed
    spec = lra_tasks.get_task(task)
    ref = REFERENCE_TRAINING[task]
    seq_len = {"paper": ref.seq_len, "reduced": ref.reduced_seq_len, "smoke": 32}[scale]
    if task in ("image", "pathfinder"):
        seq_len = 1024  # a 32x32 image is 1024 pixels at every scale (never cut)

    config = ml_collections.ConfigDict()
    config.seed = seed  # seeds parameters, graph sampling, dropout and data order
    set_run_name(config, f"lra_{task}_{mechanism}", preset)
    config.output_dir = ""  # "" -> runs/<name>-<timestamp>; an existing run there resumes
    config.init_from = ""  # "" or a run / checkpoint whose parameters start this one

    config.task = ml_collections.ConfigDict()
    config.task.name = f"lra_{task}"  # task registry name (lra/train_task.py)
    # "tfds": a dataset prepared by `python -m lra.prepare` under data_dir;
    # "generated": listops / pathfinder prepared on first use from task.generate;
    # "mock": random in-memory examples of the task's shapes (smoke runs without data).
    config.task.source = "tfds"
    config.task.data_dir = ""  # TFDS data dir; "" -> $TFDS_DATA_DIR or ~/tensorflow_datasets
    config.task.data_config = ""  # builder config name; "" -> the task's reference config
    config.task.max_length = seq_len  # padded length per input
    # Longer inputs are an error, unless True: then they are cut (and counted). Reduced
    # Text / Retrieval cut the stored 3072 / 4096-byte documents to 1024, as LRA cuts
    # documents to the model's length.
    config.task.truncate = scale == "reduced" and task in ("text", "retrieval")
    config.task.eval_batch_size = 0  # global eval batch; 0 -> train.batch_size
    config.task.max_eval_batches = 0  # cap on dev batches per evaluation (0: all; test: all)
    config.task.generate = ml_collections.ConfigDict()  # lra.builders.make_config options
    config.task.mock_examples = 64  # examples per split for source="mock"

    config.model = ml_collections.ConfigDict()
    config.model.vocab_size = spec.vocab_size  # token ids in [0, vocab_size), 0 = padding
    config.model.max_len = seq_len  # learned position table length (= padded length)
    config.model.emb_dim = 64  # model width (Table 7: 64)
    config.model.num_layers = 2  # encoder blocks (Table 7: 2)
    config.model.num_heads = 2  # attention heads (Table 7: 2)
    config.model.head_dim = 32  # width per head (Table 7: 32); heads * head_dim == emb_dim
    config.model.mlp_dim = 128  # MLP hidden width (Table 7: 128)
    config.model.dropout = 0.1  # dropout after embeddings, attention and MLP (Table 7: 0.1)
    config.model.attention_dropout = 0.1  # dropout on attention weights (Table 7: 0.1)
    config.model.pooling = "mean"  # masked mean over tokens (Table 7: MEAN)
    config.model.classifier_dim = 128  # hidden width of the classifier MLP (reference: hidden)
    config.model.num_classes = spec.num_classes  # Table 7: 10 / 2 / 2 / 10 / 2
    config.model.dtype = "float32"  # compute dtype: float32, bfloat16 (float16: no loss scaling)
    config.model.remat = False  # recompute each block in the backward pass (saves memory)
    # Sparse Transformer init: attention out and MLP fc2 kernels x 1/sqrt(2 * num_layers)
    config.model.scaled_residual_init = False
    config.model.attention = mechanism  # registry name of the attention mechanism
    # That mechanism's own options (configs/presets.py: OPTIONS at this scale).
    config.model.attention_options = presets.attention_options(mechanism, scale, seq_len)

    config.train = base.train_section(
        batch_size=ref.batch_size,  # global batch per optimizer step (Table 7)
        num_steps=ref.num_steps,  # optimizer steps (Table 7)
        learning_rate=ref.learning_rate,  # peak learning rate (Table 7)
        warmup_steps=ref.warmup_steps,  # linear warm-up steps (reference code)
        end_learning_rate_factor=0.0,  # linear decay to 0 at num_steps (reference)
        eps=1e-6,  # Adam epsilon (reference: 1e-6); weight decay and clipping off, as there
        density_lambda=lam,  # weight of the mean-density regulariser (paper Table 2)
        log_every=50,
        eval_every=ref.eval_every,  # steps between dev evaluations (reference code)
    )
    config.checkpoint = base.checkpoint_section(best_metric="accuracy", best_mode="max")
    config.mesh = base.mesh_section()

    if scale == "reduced":
        config.train.batch_size = 32
        config.train.num_steps = 600
        config.train.warmup_steps = 60
        config.train.eval_every = 100
        config.train.log_every = 10
        config.checkpoint.every_steps = 100
        config.task.eval_batch_size = 64
    elif scale == "smoke":
        config.task.source = "mock"
        config.task.mock_examples = 32
        config.model.emb_dim = 16
        config.model.num_layers = 1
        config.model.num_heads = 2
        config.model.head_dim = 8
        config.model.mlp_dim = 16
        config.model.classifier_dim = 16
        config.model.dropout = 0.0
        config.model.attention_dropout = 0.0
        config.train.batch_size = 8
        config.train.num_steps = 6
        config.train.warmup_steps = 1
        config.train.learning_rate = 3e-3
        config.train.eval_every = 3
        config.train.log_every = 1
        config.checkpoint.every_steps = 3
        config.task.max_eval_batches = 2
    return config
