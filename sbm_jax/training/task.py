"""What a task hands the training loop: batches, a loss, and which model head it needs.

The loop knows nothing else about a task. A batch is a dict of host arrays whose leading
axis is the batch axis (it is sharded over the mesh's ``data`` axis). The default
``model_inputs`` reads ``inputs`` [batch, length] and ``mask`` [batch, length]; the
default loss reads ``targets`` and, if present, ``weights``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

Array = jax.Array
Batch = Mapping[str, Any]
LossFn = Callable[[Array, Batch], tuple[Array, dict[str, Array]]]


def classification_loss(logits: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """Weighted softmax cross-entropy and accuracy.

    Args:
      logits: [..., classes] (e.g. [batch, classes] or [batch, length, classes]).
      batch: ``targets`` int [...] (logits' leading shape) and optional ``weights``
        [...] (e.g. the padding mask for token-level tasks; default all ones).

    Returns:
      (loss, {"loss", "accuracy", "weight"}): means over the weighted positions;
      ``weight`` is their total.
    """
    targets = batch["targets"]
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits of shape {logits.shape} do not match targets of shape {targets.shape}"
        )
    weights = batch.get("weights")
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    weights = weights.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(weights), 1e-9)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    loss = jnp.sum(losses * weights) / total
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    accuracy = jnp.sum(correct * weights) / total
    return loss, {"loss": loss, "accuracy": accuracy, "weight": jnp.sum(weights)}


def default_model_inputs(batch: Batch) -> dict[str, Any]:
    """The keyword arguments of a single-sequence model: ``inputs`` and ``mask``."""
    return {"inputs": batch["inputs"], "mask": batch["mask"]}


def dual_encoder_model_inputs(batch: Batch) -> dict[str, Any]:
    """Keyword arguments of ``DualEncoderClassifier``: two id/mask pairs."""
    return {
        "inputs0": batch["inputs0"],
        "mask0": batch["mask0"],
        "inputs1": batch["inputs1"],
        "mask1": batch["mask1"],
    }


@dataclasses.dataclass(frozen=True)
class Task:
    """A task as the training loop sees it.

    Attributes:
      name: the task's name (as in ``config.task.name``).
      head: model head: "classification", "token" or "dual_encoder".
      train_batches: ``start_step -> iterator`` of training batches, the first one being
        the batch for ``start_step`` (so a restarted loop sees the same data).
      eval_batches: ``() -> iterable`` of evaluation batches, or None.
      loss_fn: ``(logits, batch) -> (loss, metrics)``; metrics include "loss",
        "accuracy" and "weight" (the number of weighted positions).
      model_inputs: ``batch -> kwargs`` for the model's ``__call__``.
    """

    name: str
    head: str
    train_batches: Callable[[int], Iterator[Batch]]
    eval_batches: Callable[[], Iterable[Batch]] | None = None
    loss_fn: LossFn = classification_loss
    model_inputs: Callable[[Batch], dict[str, Any]] = default_model_inputs
