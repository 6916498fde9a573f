"""GLUE metrics against hand-computed confusion matrices."""

from __future__ import annotations

import numpy as np
import pytest

from glue.metrics import classification_metrics, confusion_matrix


def test_binary_f1_hand_computed():
    labels = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 1])
    preds = np.array([1, 1, 1, 0, 1, 1, 0, 0, 0, 0])
    # TP = 3 (idx 0-2), FN = 2 (idx 3, 9), FP = 2 (idx 4, 5), TN = 3.
    # F1(1) = 2*3 / (2*3 + 2 + 2) = 0.6; F1(0) = 2*3 / (6 + 2 + 2) = 0.6; accuracy 6/10.
    m = classification_metrics(preds, labels, 2)
    assert m["accuracy"] == pytest.approx(0.6)
    assert m["f1"] == pytest.approx(0.6)
    assert m["macro_f1"] == pytest.approx(0.6)
    assert m["num_examples"] == 10


def test_binary_f1_asymmetric():
    labels = np.array([1, 1, 0, 0, 0, 0, 0])
    preds = np.array([1, 1, 1, 1, 0, 0, 0])
    # Positive: TP 2, FP 2, FN 0 -> 4/6. Negative: TP 3, FP 0, FN 2 -> 6/8 = 0.75.
    m = classification_metrics(preds, labels, 2)
    assert m["f1"] == pytest.approx(2 / 3)
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.75) / 2)
    assert m["accuracy"] == pytest.approx(5 / 7)


def test_macro_f1_three_classes_hand_computed():
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    preds = np.array([0, 0, 1, 1, 2, 2, 2, 0, 1])
    # Class 0: TP 2, FP 1 (idx 7), FN 1 (idx 2)  -> 4/6
    # Class 1: TP 1, FP 2 (idx 2, 8), FN 1 (idx 4) -> 2/5
    # Class 2: TP 2, FP 1 (idx 4), FN 2 (idx 7, 8) -> 4/7
    expected = (4 / 6 + 2 / 5 + 4 / 7) / 3
    m = classification_metrics(preds, labels, 3)
    assert m["macro_f1"] == pytest.approx(expected)
    assert m["f1"] == pytest.approx(expected)  # MNLI's headline is macro-F1
    assert m["accuracy"] == pytest.approx(5 / 9)


def test_absent_class_scores_zero_and_confusion_counts():
    labels = np.array([0, 0, 0])
    preds = np.array([0, 0, 0])
    m = classification_metrics(preds, labels, 2)
    assert m["f1"] == 0.0  # the positive class never occurs
    assert m["macro_f1"] == pytest.approx(0.5)
    c = confusion_matrix(np.array([0, 1, 1]), np.array([1, 1, 0]), 2)
    np.testing.assert_array_equal(c, [[0, 1], [1, 1]])


def test_bad_labels_raise():
    with pytest.raises(ValueError, match="labels must lie"):
        classification_metrics(np.array([0]), np.array([-1]), 2)
    with pytest.raises(ValueError, match="predictions but"):
        classification_metrics(np.array([0, 1]), np.array([0]), 2)
