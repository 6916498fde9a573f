"""GLUE fine-tuning from an MLM pretraining checkpoint, with a JSON summary
(``run_finetuning``; the command line is ``glue.finetune``).

The encoder parameters come from the checkpoint (its model config fixes the
architecture), the classification head (mean pooling -> Dense -> ReLU -> Dense) is new.
After training, every validation split of the task (MNLI: matched and mismatched) is
scored: accuracy, F1 (binary: positive class 1) and macro-F1, plus the mean attention
density, written to summary.json (``splits`` and the Table 4 ``headline`` value).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from glue.checkpoints import find_checkpoint_dir, restore_params
from glue.data import EncodedSplit, EpochStream, get_task_spec, load_glue_split
from glue.metrics import classification_metrics
from glue.models import transplant_encoder
from glue.pretrain_lib import derive_schedule
from glue.tokenizer import TOKENIZER_FILE, load_tokenizer, special_ids
from sbm_jax.attention import STATS_COLLECTION
from sbm_jax.models import build_model
from sbm_jax.training import (
    ConfigError,
    MetricsWriter,
    ProgressBar,
    TrainState,
    default_output_dir,
    make_mesh,
    make_optimizer,
    prepare_output_dir,
    replicated,
    shard_batch,
    train,
    validate_config,
)
from sbm_jax.training.metrics import to_python
from sbm_jax.training.stats import collect_attention_stats
from sbm_jax.training.task import Batch, Task, classification_loss

# ``model`` fields that define the encoder and so must come from the checkpoint.
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "max_len",
    "emb_dim",
    "num_layers",
    "num_heads",
    "head_dim",
    "mlp_dim",
    "attention",
    "attention_options",
)


def resolve_tokenizer_path(config: Any, checkpoint_dir: str) -> str:
    """``data.tokenizer`` if set, else ``tokenizer.json`` beside ``checkpoints/``."""
    if config.data.tokenizer:
        return str(config.data.tokenizer)
    return os.path.join(os.path.dirname(checkpoint_dir), TOKENIZER_FILE)


def apply_checkpoint_architecture(config: Any, meta: dict[str, Any]) -> None:
    """Copy the encoder fields of the checkpoint's model config into ``config.model``.

    A different ``model.attention`` is an error (the preset names the wrong mechanism).
    """
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise ValueError("the pretraining checkpoint's metadata holds no model config")
    if str(saved.get("attention")) != str(config.model.attention):
        raise ConfigError(
            f"model.attention={config.model.attention!r} but the checkpoint was pretrained "
            f"with {saved.get('attention')!r}; pick the matching mechanism preset"
        )
    with config.unlocked():
        for name in ARCHITECTURE_FIELDS:
            if name not in saved:
                raise ValueError(f"the checkpoint's model config lacks {name!r}")
            value = saved[name]
            if name == "attention_options":
                value = ml_collections.ConfigDict(value or {})
                if value.to_dict() != config.model.attention_options.to_dict():
                    logging.info("model.attention_options taken from the checkpoint: %s", value)
            config.model[name] = value
    if int(config.data.max_len) > int(config.model.max_len):
        raise ConfigError(
            f"data.max_len={config.data.max_len} exceeds the checkpoint's model.max_len="
            f"{config.model.max_len}"
        )


def build_glue_task(config: Any, train_split: EncodedSplit, pad_id: int) -> Task:
    """Classification ``Task`` over an encoded training split."""
    batch_size = int(config.train.batch_size)
    max_len = int(config.data.max_len)
    stream = EpochStream(len(train_split), batch_size, int(config.seed))

    def train_batches(start_step: int) -> Iterator[Batch]:
        for idx in stream.iterate(start_step):
            yield train_split.batch(idx, max_len, pad_id)

    return Task(
        name=f"glue_{config.task.glue_task}",
        head="classification",
        train_batches=train_batches,
        eval_batches=None,
        loss_fn=classification_loss,
    )


def make_predict_fn(model: Any):
    """Jitted ``(params, batch, rng) -> (predictions [batch], mean density or -1)``."""

    def predict(params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, mutables = model.apply(
            {"params": params},
            batch["inputs"],
            batch["mask"],
            deterministic=True,
            rngs={"sample": rng, "dropout": rng},
            mutable=[STATS_COLLECTION],
        )
        stats = collect_attention_stats(mutables)
        density = stats.get("density", jnp.asarray(-1.0, jnp.float32))
        return jnp.argmax(logits, axis=-1), density

    return jax.jit(predict)


def evaluate_split(
    predict_fn: Any,
    params: Any,
    split: EncodedSplit,
    *,
    batch_size: int,
    max_len: int,
    pad_id: int,
    num_classes: int,
    mesh: Any,
    seed: int,
) -> dict[str, float]:
    """Accuracy, F1, macro-F1 and mean density of ``split`` (every example once)."""
    predictions = []
    densities = []
    rng = jax.random.PRNGKey(seed + 1)
    for i, start in enumerate(range(0, len(split), batch_size)):
        rows = np.arange(start, start + batch_size)
        real = rows < len(split)
        batch = split.batch(np.where(real, rows, rows % len(split)), max_len, pad_id)
        preds, density = predict_fn(params, shard_batch(batch, mesh), jax.random.fold_in(rng, i))
        predictions.append(np.asarray(jax.device_get(preds))[real])
        densities.append(float(jax.device_get(density)))
    metrics = classification_metrics(np.concatenate(predictions), split.labels, num_classes)
    if densities and densities[0] >= 0:
        metrics["density"] = float(np.mean(densities))
    return metrics


def run_finetuning(
    config: ml_collections.ConfigDict,
    init_checkpoint: str,
    output_dir: str | None = None,
    progress_stream: Any = None,
) -> dict[str, Any]:
    """Fine-tune on ``task.glue_task``; returns the summary (also in summary.json)."""
    spec = get_task_spec(str(config.task.glue_task))
    if int(config.model.num_classes) != spec.num_classes:
        raise ConfigError(
            f"model.num_classes={config.model.num_classes} but {spec.name} has "
            f"{spec.num_classes} classes"
        )
    checkpoint_dir = find_checkpoint_dir(init_checkpoint, flag="--init_checkpoint")
    params, meta, pretrain_step = restore_params(checkpoint_dir, flag="--init_checkpoint")
    apply_checkpoint_architecture(config, meta)
    tokenizer_path = resolve_tokenizer_path(config, checkpoint_dir)
    flag = "--tokenizer" if config.data.tokenizer else "--tokenizer (or --init_checkpoint)"
    tokenizer = load_tokenizer(tokenizer_path, flag=flag)
    if tokenizer.get_vocab_size() > int(config.model.vocab_size):
        raise ConfigError(
            f"--tokenizer={tokenizer_path!r} has {tokenizer.get_vocab_size()} tokens but the "
            f"checkpoint's model.vocab_size is {config.model.vocab_size}"
        )
    special = special_ids(tokenizer)
    data_dir = str(config.data.tfds_data_dir) or None
    max_len = int(config.data.max_len)

    download = bool(config.data.tfds_download)

    def load(split: str, limit: int) -> EncodedSplit:
        return load_glue_split(spec, split, tokenizer, max_len, special, data_dir, limit, download)

    train_split = load("train", int(config.data.max_train_examples))
    eval_splits = {s: load(s, int(config.data.max_eval_examples)) for s in spec.eval_splits}
    derive_schedule(config, len(train_split))
    validate_config(config, head="classification")
    output_dir = prepare_output_dir(output_dir or default_output_dir(config))
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))

    mesh = make_mesh()
    task = build_glue_task(config, train_split, special.pad)
    model = build_model(config.model, "classification")
    init_rng, step_rng = jax.random.split(jax.random.PRNGKey(int(config.seed)))
    sample = train_split.batch(np.arange(min(len(train_split), 1)), max_len, special.pad)
    fresh = jax.jit(
        lambda b: model.init(
            {"params": init_rng, "sample": init_rng, "dropout": init_rng},
            b["inputs"],
            b["mask"],
            deterministic=True,
        )
    )(sample)["params"]
    state = TrainState.create(
        apply_fn=model.apply,
        params=transplant_encoder(fresh, params),
        tx=make_optimizer(config.train),
        rng=step_rng,
    )

    writer = MetricsWriter(output_dir)
    progress = ProgressBar(int(config.train.num_steps), stream=progress_stream)
    try:
        result = train(
            config, task, model=model, state=state, mesh=mesh, writer=writer, progress=progress
        )
    finally:
        progress.close()
        writer.close()

    predict_fn = make_predict_fn(model)
    params_out = jax.device_put(result.state.params, replicated(mesh))
    splits = {
        name: evaluate_split(
            predict_fn,
            params_out,
            split,
            batch_size=int(config.train.eval_batch_size),
            max_len=max_len,
            pad_id=special.pad,
            num_classes=spec.num_classes,
            mesh=mesh,
            seed=int(config.seed),
        )
        for name, split in eval_splits.items()
    }
    headline = float(np.mean([m[spec.metric] for m in splits.values()]))
    last = result.history[-1] if result.history else {}
    summary = to_python(
        {
            "name": str(config.name),
            "task": spec.name,
            "mechanism": str(config.get("mechanism", config.model.attention)),
            "attention": str(config.model.attention),
            "metric": spec.metric,
            "headline": headline,
            "splits": splits,
            "train_loss": last.get("loss"),
            "train_accuracy": last.get("accuracy"),
            "steps": int(config.train.num_steps),
            "train_examples": len(train_split),
            "init_checkpoint": checkpoint_dir,
            "pretrain_step": pretrain_step,
            "wall_time_s": result.wall_time_s,
            "output_dir": output_dir,
        }
    )
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary
