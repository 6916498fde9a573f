"""Classification metrics of the GLUE summaries: accuracy, binary F1, macro-F1.

F1 of a class is ``2 TP / (2 TP + FP + FN)`` (0 when the class never occurs in either
predictions or labels). Binary tasks report the F1 of the positive class (label 1: SST-2
positive, QQP duplicate, QNLI not_entailment as TFDS labels it); MNLI reports the
unweighted mean of the three per-class F1 scores (macro-F1).
"""

from __future__ import annotations

import numpy as np


def confusion_matrix(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts int64 [num_classes (true), num_classes (predicted)]."""
    predictions = np.asarray(predictions).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    if predictions.shape != labels.shape:
        raise ValueError(f"{predictions.shape[0]} predictions but {labels.shape[0]} labels")
    for name, values in (("labels", labels), ("predictions", predictions)):
        if values.size and (values.min() < 0 or values.max() >= num_classes):
            raise ValueError(f"{name} must lie in [0, {num_classes}); got {np.unique(values)}")
    flat = labels.astype(np.int64) * num_classes + predictions.astype(np.int64)
    return np.bincount(flat, minlength=num_classes**2).reshape(num_classes, num_classes)


def per_class_f1(confusion: np.ndarray) -> np.ndarray:
    """F1 of every class, float64 [num_classes]."""
    tp = np.diag(confusion).astype(np.float64)
    fp = confusion.sum(axis=0) - tp
    fn = confusion.sum(axis=1) - tp
    denom = 2 * tp + fp + fn
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)


def classification_metrics(
    predictions: np.ndarray, labels: np.ndarray, num_classes: int
) -> dict[str, float]:
    """``accuracy``, ``f1`` (binary: positive class 1; otherwise macro) and ``macro_f1``.

    Also ``num_examples``. For ``num_classes == 2``, ``f1`` is the positive-class F1.
    """
    return metrics_from_confusion(confusion_matrix(predictions, labels, num_classes))


def metrics_from_confusion(confusion: np.ndarray) -> dict[str, float]:
    """``classification_metrics`` from a confusion matrix [true, predicted] (what the
    trainer's evaluation accumulates)."""
    confusion = np.asarray(confusion)
    num_classes = confusion.shape[0]
    total = int(confusion.sum())
    f1s = per_class_f1(confusion)
    accuracy = float(np.trace(confusion) / total) if total else 0.0
    macro = float(f1s.mean())
    f1 = float(f1s[1]) if num_classes == 2 else macro
    return {"accuracy": accuracy, "f1": f1, "macro_f1": macro, "num_examples": total}
