"""A tiny trainer run for the resilience and multi-process tests, importable and runnable.

The task is LRA ListOps on in-memory mock examples (``task.source = "mock"``: the real
grain pipeline, no files), with the smoke-sized model. ``poisoned`` wraps it so that one
training batch carries a NaN that the loss picks up; ``slowed`` makes every batch take a
while, so a test can signal a run part-way.

As a script (one run, printed as ``RESULT {json}``; a ``NonFiniteError`` exits 3)::

  python tests/resilience_task.py OUT --steps=8 [--attention=sbm] [--sleep=0.3]
      [--max_per_device_batch=2] [--coordinator=HOST:PORT --num_processes=2 --process_id=0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as a script from a checkout: make the root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NONFINITE_EXIT = 3


def make_config(
    attention: str = "sbm", num_steps: int = 8, batch_size: int = 8, max_per_device: int = 0
) -> Any:
    """ListOps smoke config on mock data: ``num_steps`` steps, metrics every step."""
    from configs.lra import listops

    config = listops.get_config(f"{attention},smoke")
    config.task.source = "mock"
    config.task.mock_examples = 32
    config.task.max_eval_batches = 1
    config.train.num_steps = num_steps
    config.train.batch_size = batch_size
    config.train.max_per_device_batch = max_per_device
    config.train.log_every = 1
    config.train.eval_every = 0
    config.train.learning_rate = 1e-2
    return config


def make_task(config: Any) -> Any:
    """The LRA ListOps ``Task`` of ``config``."""
    import lra.train_task as lra_train

    return lra_train.build_lra_task("listops", config)


def poisoned(task: Any, poison_index: int) -> Any:
    """``task`` whose training batch number ``poison_index`` (0-based: the batch of metrics
    step ``poison_index + 1``) makes the loss NaN; the other batches train as before.

    Every training batch gets a ``poison`` float32 [batch] entry (NaN in the bad batch, 0
    elsewhere); the loss adds its sum. Evaluation batches have none and are unaffected.
    """
    import jax.numpy as jnp

    from sbm_jax.training.task import classification_loss

    def train_batches(start: int) -> Iterator[dict[str, Any]]:
        for index, batch in enumerate(task.train_batches(start), start):
            batch = dict(batch)
            value = np.nan if index == poison_index else 0.0
            batch["poison"] = np.full(batch["targets"].shape, value, np.float32)
            yield batch

    def loss_fn(logits: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        loss, metrics = classification_loss(logits, batch)
        if "poison" in batch:
            loss = loss + jnp.sum(batch["poison"])
        return loss, {**metrics, "loss": loss}

    return dataclasses.replace(
        task, train_batches=train_batches, process_train_batches=None, loss_fn=loss_fn
    )


def slowed(task: Any, seconds: float) -> Any:
    """``task`` whose training batches each take ``seconds`` longer to arrive."""

    def delay(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            time.sleep(seconds)
            yield batch

    process = task.process_train_batches
    return dataclasses.replace(
        task,
        train_batches=lambda start: delay(task.train_batches(start)),
        process_train_batches=None
        if process is None
        else (lambda start, rows: delay(process(start, rows))),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--attention", default="sbm")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_per_device_batch", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    args = parser.parse_args(argv)

    from sbm_jax.training.distributed import maybe_initialize_distributed

    maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id)

    import jax

    from sbm_jax.training.trainer import NonFiniteError, train_and_evaluate

    config = make_config(args.attention, args.steps, args.batch_size, args.max_per_device_batch)
    task = make_task(config)
    if args.sleep:
        task = slowed(task, args.sleep)
    try:
        result = train_and_evaluate(config, task, args.output_dir)
    except NonFiniteError as e:
        print(f"ERROR {e}", flush=True)
        return NONFINITE_EXIT
    keep = ("stopped_at", "reason", "resumed_from", "steps", "processes", "devices")
    out = {k: result[k] for k in keep if k in result}
    out.update(process_index=jax.process_index(), process_count=jax.process_count())
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
