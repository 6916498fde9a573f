"""What a task hands the trainer: batches, a loss, the model head, and optional hooks.

The trainer knows nothing else about a task. A batch is a dict of host arrays whose leading
axis is the batch axis (it is sharded over the mesh's ``data`` axis). The default
``model_inputs`` reads ``inputs`` [batch, length] and ``mask`` [batch, length]; the
default loss reads ``targets`` and, if present, ``weights``. Batches may carry
``example_mask`` bool [batch] (False for the filler rows that complete a last evaluation
batch); evaluation statistics skip those rows: the default loss weighs them 0, and a
task's own ``loss_fn`` must do the same.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Array = jax.Array
Batch = Mapping[str, Any]
LossFn = Callable[[Array, Batch], tuple[Array, dict[str, Array]]]
Batches = Callable[[], Iterable[Batch]]


def classification_loss(logits: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """Weighted softmax cross-entropy and accuracy.

    Args:
      logits: [..., classes] (e.g. [batch, classes] or [batch, length, classes]).
      batch: ``targets`` int [...] (logits' leading shape) and optional ``weights``
        [...] (e.g. the padding mask for token-level tasks; default all ones) and
        ``example_mask`` bool [batch] (rows where it is False weigh nothing: the filler
        rows of a last evaluation batch, whatever ``weights`` says).

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
    example = batch.get("example_mask")
    if example is not None:
        example = jnp.asarray(example, jnp.float32)
        weights = weights * example.reshape(example.shape + (1,) * (weights.ndim - 1))
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
    """A task as the trainer sees it.

    Attributes:
      name: the task's name (as in ``config.task.name``).
      head: model head: "classification", "token" or "dual_encoder".
      train_batches: ``start_step -> iterator`` of training batches, the first one being
        the batch for ``start_step`` (so a resumed run sees the same data).
      eval_batches: ``() -> iterable`` of the dev split (evaluated during training; it
        picks the best checkpoint), or None.
      loss_fn: ``(logits, batch) -> (loss, metrics)``; metrics include "loss",
        "accuracy" and "weight" (the number of weighted positions).
      model_inputs: ``batch -> kwargs`` for the model's ``__call__``.
      test_splits: ``{name: () -> iterable}``, evaluated once at the best dev checkpoint
        (the first is the headline: ``test_accuracy`` etc. in the summary). None: the
        dev split is scored there instead.
      process_train_batches: ``(start_step, rows) -> iterator`` of the rows ``rows``
        (global row indices, int [n]) of each training batch from ``start_step`` on:
        what one process of a multi-process job reads. None: the rows are cut from
        ``train_batches`` (every process then reads whole batches).
      make_model: ``model config section -> flax Module``; None:
        ``sbm_jax.models.build_model(config.model, head)``.
      init_params: ``(fresh params, loaded params) -> params``: how the parameters of
        ``config.init_from`` (a run or checkpoint) enter a fresh model (e.g. a pretrained
        encoder into a classifier). None: the loaded tree must match the fresh one.
      confusion_classes: > 0 for classification tasks that want a confusion matrix
        [true, predicted] of every evaluated split, given to ``eval_metrics``.
      eval_metrics: ``confusion [C, C] -> {name: value}`` (e.g. F1), merged into each
        evaluation's metrics (``checkpoint.best_metric`` may name them).
      predict_splits: ``{name: () -> iterable}`` of unlabelled batches, each with
        ``index`` int [batch] (the example id) and ``example_mask``; their argmax
        predictions at the best checkpoint go to ``write_predictions``.
      write_predictions: ``(name, index [n], predictions [n], output_dir) -> path``.
      summarize: ``summary -> extra fields`` merged into summary.json.
      save_files: ``output_dir -> None``: files the run directory must hold besides the
        trainer's (e.g. a tokenizer), written by process 0 once the directory exists.
    """

    name: str
    head: str
    train_batches: Callable[[int], Iterator[Batch]]
    eval_batches: Batches | None = None
    loss_fn: LossFn = classification_loss
    model_inputs: Callable[[Batch], dict[str, Any]] = default_model_inputs
    test_splits: Mapping[str, Batches] | None = None
    process_train_batches: Callable[[int, np.ndarray], Iterator[Batch]] | None = None
    make_model: Callable[[Any], Any] | None = None
    init_params: Callable[[Any, Any], Any] | None = None
    confusion_classes: int = 0
    eval_metrics: Callable[[np.ndarray], dict[str, float]] | None = None
    predict_splits: Mapping[str, Batches] | None = None
    write_predictions: Callable[[str, np.ndarray, np.ndarray, str], str] | None = None
    summarize: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    save_files: Callable[[str], None] | None = None

    # Mappings are not hashable; the trainer caches compiled steps by task identity.
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


def build_task_model(task: Task, model_config: Any) -> Any:
    """The flax module a task trains: ``task.make_model`` or ``build_model``."""
    if task.make_model is not None:
        return task.make_model(model_config)
    from sbm_jax.models import build_model

    return build_model(model_config, task.head)


#: False while the trainer only checks a config (``--dry_run``): a task whose data
#: would have to be generated or downloaded first raises ``FileNotFoundError`` instead.
may_prepare_data: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "may_prepare_data", default=True
)
