"""BERT masking for masked-language-model pretraining, on the host (numpy).

Every non-special token is selected with probability ``mask_rate`` (independently, so
the selected count per row is binomial). A selected token becomes ``<mask>`` with
probability ``mask_token_rate``, a random ordinary token with probability
``random_token_rate``, and stays unchanged otherwise (BERT: 0.15; 0.8 / 0.1 / 0.1).
Special tokens (``<cls>``, ``<sep>``, ``<pad>``, ...) are never selected.

The model scores only selected positions: each row lists up to ``max_predictions`` of
them (``positions``, ``targets``, ``weights``; unused slots have weight 0). If a row
selects more than ``max_predictions`` tokens, a uniformly random subset of that size is
kept and the rest are left untouched (not masked, not scored), as BERT's
``max_predictions_per_seq`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mask_tokens(
    rng: np.random.Generator,
    ids: np.ndarray,
    *,
    special_ids: Sequence[int],
    pad_id: int,
    mask_id: int,
    random_low: int,
    random_high: int,
    max_predictions: int,
    mask_rate: float = 0.15,
    mask_token_rate: float = 0.8,
    random_token_rate: float = 0.1,
) -> dict[str, np.ndarray]:
    """Corrupt ``ids`` for MLM.

    Args:
      rng: numpy generator (the only randomness).
      ids: int [batch, length] packed token ids (``<pad>`` where there is no text).
      special_ids: ids never selected (all special tokens, padding included).
      pad_id: id of ``<pad>``.
      mask_id: id of ``<mask>``.
      random_low, random_high: random replacements are drawn from
        ``[random_low, random_high)`` (the ordinary tokens).
      max_predictions: P, scored positions per row (the cap described above).
      mask_rate, mask_token_rate, random_token_rate: the rates described above.

    Returns:
      ``inputs`` int32 [batch, length] (corrupted ids), ``mask`` bool [batch, length]
      (True where ``ids`` is not ``pad_id``), ``positions`` int32 [batch, P],
      ``targets`` int32 [batch, P] (original ids there, 0 in unused slots),
      ``weights`` float32 [batch, P] (1 for a scored slot, 0 for an unused one).
    """
    if ids.ndim != 2:
        raise ValueError(f"ids must be [batch, length], got shape {ids.shape}")
    if not 0.0 <= mask_rate <= 1.0:
        raise ValueError(f"data.mask_rate={mask_rate} must lie in [0, 1]")
    if mask_token_rate < 0 or random_token_rate < 0 or mask_token_rate + random_token_rate > 1:
        raise ValueError(
            f"data.mask_token_rate={mask_token_rate} and data.random_token_rate="
            f"{random_token_rate} must be non-negative with a sum of at most 1"
        )
    if max_predictions < 1:
        raise ValueError(f"data.max_predictions={max_predictions} must be positive")
    if random_high <= random_low:
        raise ValueError(f"no ordinary tokens to draw from: [{random_low}, {random_high})")
    batch, length = ids.shape
    ids = ids.astype(np.int32)
    eligible = ~np.isin(ids, np.asarray([*special_ids, pad_id], np.int32))
    selected = eligible & (rng.random((batch, length)) < mask_rate)

    # Keep at most P per row: a random order among selected positions, unselected last.
    keys = np.where(selected, rng.random((batch, length)), 2.0)
    order = np.argsort(keys, axis=1, kind="stable")[:, :max_predictions]  # [batch, <=P]
    kept = np.take_along_axis(selected, order, axis=1)
    width = order.shape[1]
    positions = np.zeros((batch, max_predictions), np.int32)
    positions[:, :width] = np.where(kept, order, 0)
    weights = np.zeros((batch, max_predictions), np.float32)
    weights[:, :width] = kept
    targets = np.take_along_axis(ids, positions, axis=1) * (weights > 0)

    chosen = np.zeros((batch, length), np.bool_)
    rows = np.broadcast_to(np.arange(batch)[:, None], order.shape)
    chosen[rows[kept], order[kept]] = True

    action = rng.random((batch, length))
    to_mask = chosen & (action < mask_token_rate)
    to_random = (
        chosen & (action >= mask_token_rate) & (action < mask_token_rate + random_token_rate)
    )
    random_ids = rng.integers(random_low, random_high, size=(batch, length), dtype=np.int32)
    inputs = np.where(to_mask, np.int32(mask_id), ids)
    inputs = np.where(to_random, random_ids, inputs).astype(np.int32)
    return {
        "inputs": inputs,
        "mask": ids != np.int32(pad_id),
        "positions": positions,
        "targets": targets.astype(np.int32),
        "weights": weights,
    }
