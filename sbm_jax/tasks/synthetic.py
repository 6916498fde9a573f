"""The paper's synthetic task (section 5.1, fig. 4): find repeated tokens.

Each sequence holds ``seq_len`` integers drawn uniformly from ``{1, ..., seq_len}``; the
target of a token is 1 when the same integer occurs elsewhere in the sequence, else 0.
About ``1 - (1 - 1/N)^(N-1) ~ 63%`` of tokens are repeated, so predicting 1 everywhere
scores ~63%. With one layer and one head, the head has to see every token to reach 100%.

Batches are generated on the host, a new one every step. The batch of step ``s`` comes
from ``numpy.random.default_rng([seed, s])``, so a restarted run sees the same data.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from sbm_jax.tasks.registry import register_task
from sbm_jax.training.task import Batch, Task, classification_loss

_TRAIN_STREAM = 0
_EVAL_STREAM = 1
_TEST_STREAM = 2  # the test split: as many batches as dev, never used to pick a checkpoint


def duplicate_labels(tokens: np.ndarray) -> np.ndarray:
    """1 where a token's value occurs elsewhere in its row.

    Args:
      tokens: int [batch, length], values >= 0.

    Returns:
      int32 [batch, length].
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    batch, _ = tokens.shape
    width = int(tokens.max(initial=0)) + 1
    flat = tokens + width * np.arange(batch)[:, None]  # distinct bins per row
    counts = np.bincount(flat.ravel(), minlength=batch * width)
    return (counts[flat] > 1).astype(np.int32)


def sample_batch(rng: np.random.Generator, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """One batch of the task.

    Returns:
      ``inputs`` int32 [batch, seq_len] in {1..seq_len}, ``mask`` bool (all True),
      ``targets`` int32 (the duplicate labels), ``weights`` float32 (all 1).
    """
    tokens = rng.integers(1, seq_len + 1, size=(batch_size, seq_len), dtype=np.int32)
    return {
        "inputs": tokens,
        "mask": np.ones((batch_size, seq_len), np.bool_),
        "targets": duplicate_labels(tokens),
        "weights": np.ones((batch_size, seq_len), np.float32),
    }


def accuracy_ceiling(seq_len: int, density: float) -> float:
    """Best token accuracy of any model that sees each other token with probability ``density``.

    The model is told, for each token, only whether one of the other tokens it sees holds
    the same value (independently per pair, as an SBM graph at uniform density samples
    them). A seen match proves a repeat; with none seen, the best guess is the likelier
    label given that none was seen. With ``D ~ Binomial(N - 1, 1/N)`` repeats of a token
    and ``rho`` the density::

        P(none seen) = E[(1 - rho)^D],   P(unique | none seen) = P(D = 0) / P(none seen)
        ceiling = 1 - P(none seen) + P(none seen) * max(P(unique | none), 1 - P(unique | none))

    At ``rho = 0`` this is the all-ones baseline (~0.63); it stays there up to
    ``rho ~ 0.30`` (for any N >= 16), and it needs ``rho ~ 0.98`` for 99%: the paper's
    "the sole head must perform full attention".
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density={density} must lie in [0, 1]")
    n, q = seq_len - 1, 1.0 / seq_len
    none = 0.0
    p_unique = (1.0 - q) ** n
    for d in range(n + 1):
        log_p = math.lgamma(n + 1) - math.lgamma(d + 1) - math.lgamma(n - d + 1)
        log_p += d * math.log(q) + (n - d) * math.log1p(-q)
        none += math.exp(log_p) * (1.0 - density) ** d
    unique_given_none = p_unique / none
    return 1.0 - none + none * max(unique_given_none, 1.0 - unique_given_none)


def batch_for_step(seed: int, step: int, batch_size: int, seq_len: int, stream: int = 0) -> Batch:
    """The batch of training step ``step`` (stream 0), or dev (1) or test (2) batch ``step``."""
    return sample_batch(np.random.default_rng([seed, stream, step]), batch_size, seq_len)


def check_config(config: Any) -> None:
    """Task-specific checks; messages name the field."""
    task, model = config.task, config.model
    seq_len = task.get("seq_len")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"task.seq_len={seq_len!r} must be an integer >= 2")
    if model.get("vocab_size", 0) < seq_len + 1:
        raise ValueError(
            f"model.vocab_size={model.get('vocab_size')} must be at least task.seq_len + 1 "
            f"= {seq_len + 1} (tokens take values 1..seq_len)"
        )
    if model.get("max_len", 0) < seq_len:
        raise ValueError(f"model.max_len={model.get('max_len')} is below task.seq_len={seq_len}")
    if model.get("num_classes") != 2:
        raise ValueError(f"model.num_classes={model.get('num_classes')} must be 2 for this task")
    eval_batches = task.get("eval_batches", 0)
    if not isinstance(eval_batches, int) or eval_batches < 0:
        raise ValueError(f"task.eval_batches={eval_batches!r} must be a non-negative integer")


@register_task("synthetic")
def build_task(config: Any) -> Task:
    """The synthetic task from ``config.task`` (seq_len, eval_batches) and ``config.seed``:
    endless training batches, and ``eval_batches`` batches each of dev (checkpoint
    choice) and test (reported once, at the best checkpoint), from three streams."""
    check_config(config)
    seed = int(config.seed)
    seq_len = int(config.task.seq_len)
    batch_size = int(config.train.batch_size)
    num_eval = int(config.task.get("eval_batches", 0))

    def train_batches(start_step: int) -> Iterator[Batch]:
        step = start_step
        while True:
            yield batch_for_step(seed, step, batch_size, seq_len, _TRAIN_STREAM)
            step += 1

    def eval_batches() -> Iterator[Batch]:
        for i in range(num_eval):
            yield batch_for_step(seed, i, batch_size, seq_len, _EVAL_STREAM)

    def test_batches() -> Iterator[Batch]:
        for i in range(num_eval):
            yield batch_for_step(seed, i, batch_size, seq_len, _TEST_STREAM)

    return Task(
        name="synthetic",
        head="token",
        train_batches=train_batches,
        eval_batches=eval_batches if num_eval > 0 else None,
        loss_fn=classification_loss,
        # its own batches: with train.eval_every > 0 the best checkpoint is picked on dev,
        # and scoring it on the same batches would report the best of several draws
        test_splits={"test": test_batches} if num_eval > 0 else None,
    )
