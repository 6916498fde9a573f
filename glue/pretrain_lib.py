"""MLM pretraining for GLUE (``run_pretraining``; the command line is ``glue.pretrain``):
tokenizer, packed corpus, training, checkpoint.

Writes into the output directory: tokenizer.json, checkpoints/<step>/ (parameters and
the model config), config.json, metrics.jsonl (per step: loss and accuracy on masked
positions, density and density_per_head per layer/head where the mechanism sows it),
metrics.csv, metrics.png and summary.json.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections

from glue.checkpoints import CHECKPOINT_DIR, save_params
from glue.data import steps_for_epochs
from glue.mlm import build_mlm_task_from_data, load_documents, pack_corpus, prepare_tokenizer
from glue.models import build_mlm_model
from sbm_jax.training import (
    MetricsWriter,
    ProgressBar,
    default_output_dir,
    plot_metrics,
    prepare_output_dir,
    train,
    validate_config,
)
from sbm_jax.training.metrics import to_python


def derive_schedule(config: Any, num_examples: int) -> None:
    """Set ``train.num_steps`` from ``train.num_epochs`` (when > 0) and
    ``train.warmup_steps`` from ``train.warmup_fraction``."""
    train_cfg = config.train
    epochs = float(train_cfg.num_epochs)
    if epochs < 0:
        raise ValueError(f"train.num_epochs={epochs} must be >= 0")
    if epochs > 0:
        train_cfg.num_steps = steps_for_epochs(num_examples, int(train_cfg.batch_size), epochs)
    fraction = float(train_cfg.warmup_fraction)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"train.warmup_fraction={fraction} must lie in [0, 1)")
    train_cfg.warmup_steps = int(fraction * int(train_cfg.num_steps))


def run_pretraining(
    config: ml_collections.ConfigDict,
    output_dir: str | None = None,
    progress_stream: Any = None,
) -> dict[str, Any]:
    """Pretrain as configured; returns the summary (also written to summary.json)."""
    documents = load_documents(config)
    output_dir = prepare_output_dir(output_dir or default_output_dir(config))
    tokenizer, tokenizer_path = prepare_tokenizer(config, documents, output_dir)
    config.model.vocab_size = tokenizer.get_vocab_size()  # a small corpus may give fewer
    data = pack_corpus(config, tokenizer, documents)
    derive_schedule(config, len(data.train))
    validate_config(config, head="token")
    with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))

    task = build_mlm_task_from_data(config, data)
    model = build_mlm_model(config.model)
    writer = MetricsWriter(output_dir)
    progress = ProgressBar(int(config.train.num_steps), stream=progress_stream)
    try:
        result = train(config, task, model=model, writer=writer, progress=progress)
    finally:
        progress.close()
        writer.close()

    params = jax.device_get(result.state.params)
    meta = {
        "model": config.model.to_dict(),
        "step": int(config.train.num_steps),
        "tokenizer": os.path.basename(tokenizer_path) if tokenizer_path else "",
        "name": str(config.name),
    }
    checkpoint_dir = save_params(
        os.path.join(output_dir, CHECKPOINT_DIR), int(config.train.num_steps), params, meta
    )
    plot = plot_metrics(
        [writer.csv_path],
        os.path.join(output_dir, "metrics.png"),
        labels=[str(config.name)],
        title=f"{config.name} ({config.model.attention}) MLM",
    )
    last = result.history[-1] if result.history else {}
    summary = {
        "name": str(config.name),
        "attention": str(config.model.attention),
        "step": last.get("step"),
        "mlm_loss": last.get("loss"),
        "mlm_accuracy": last.get("accuracy"),
        "density": last.get("density"),
        "density_per_head": last.get("density_per_head"),
        "eval": result.eval_metrics,
        "first_mlm_loss": result.history[0]["loss"] if result.history else None,
        "train_sequences": len(data.train),
        "eval_sequences": len(data.eval),
        "corpus_tokens": data.num_tokens,
        "vocab_size": data.vocab_size,
        "wall_time_s": result.wall_time_s,
        "steps_per_s": result.steps_per_s,
        "output_dir": output_dir,
        "checkpoint_dir": checkpoint_dir,
        "tokenizer": tokenizer_path,
        "plot": plot,
    }
    summary = to_python(summary)
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary
