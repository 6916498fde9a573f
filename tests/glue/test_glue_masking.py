"""MLM masking: rates within binomial bounds; special tokens and padding never masked."""

from __future__ import annotations

import numpy as np
import pytest

from glue.masking import mask_tokens

PAD, CLS, SEP, MASK, UNK = 0, 1, 2, 3, 4
SPECIAL = (PAD, CLS, SEP, MASK, UNK)
VOCAB = 1000


def _ids(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Packed-looking rows: <cls> at 0, <sep> sprinkled, padded tails of random length."""
    ids = rng.integers(5, VOCAB, size=(batch, length), dtype=np.int32)
    ids[:, 0] = CLS
    ids[rng.random((batch, length)) < 0.05] = SEP
    ids[:, 0] = CLS
    lengths = rng.integers(length // 2, length + 1, size=batch)
    ids[np.arange(length)[None, :] >= lengths[:, None]] = PAD
    return ids


def _within(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """|count - n p| <= sigmas * sqrt(n p (1 - p)) (a binomial bound, ~6e-7 two-sided)."""
    return abs(count - n * p) <= sigmas * np.sqrt(n * p * (1 - p))


def _mask(ids: np.ndarray, rng: np.random.Generator, max_predictions: int, **kw):
    return mask_tokens(
        rng,
        ids,
        special_ids=SPECIAL,
        pad_id=PAD,
        mask_id=MASK,
        random_low=5,
        random_high=VOCAB,
        max_predictions=max_predictions,
        **kw,
    )


def test_rates_within_binomial_bounds():
    rng = np.random.default_rng(0)
    ids = _ids(rng, 256, 128)
    out = _mask(ids, np.random.default_rng(1), max_predictions=128)
    eligible = ~np.isin(ids, SPECIAL)
    chosen = np.zeros_like(eligible)
    rows = np.repeat(np.arange(ids.shape[0])[:, None], out["positions"].shape[1], axis=1)
    scored = out["weights"] > 0
    chosen[rows[scored], out["positions"][scored]] = True
    n_eligible, n_chosen = int(eligible.sum()), int(chosen.sum())
    assert _within(n_chosen, n_eligible, 0.15)
    # Targets are the original ids at the scored positions.
    np.testing.assert_array_equal(
        out["targets"][scored], ids[rows[scored], out["positions"][scored]]
    )
    inputs = out["inputs"]
    as_mask = chosen & (inputs == MASK)
    changed = chosen & (inputs != MASK) & (inputs != ids)
    assert _within(int(as_mask.sum()), n_chosen, 0.8)
    # A random replacement equals the original with probability 1 / (VOCAB - 5).
    assert _within(int(changed.sum()), n_chosen, 0.1 * (1 - 1 / (VOCAB - 5)))
    assert np.all(inputs[changed] >= 5) and np.all(inputs[changed] < VOCAB)
    # Nothing outside the chosen positions changes.
    np.testing.assert_array_equal(inputs[~chosen], ids[~chosen])


def test_special_tokens_and_padding_never_masked():
    rng = np.random.default_rng(2)
    ids = _ids(rng, 64, 64)
    out = _mask(ids, np.random.default_rng(3), max_predictions=64, mask_rate=1.0)
    special = np.isin(ids, SPECIAL)
    np.testing.assert_array_equal(out["inputs"][special], ids[special])
    scored = out["weights"] > 0
    rows = np.repeat(np.arange(ids.shape[0])[:, None], out["positions"].shape[1], axis=1)
    assert not np.any(special[rows[scored], out["positions"][scored]])
    # mask_rate=1 selects every ordinary token: one scored slot each.
    np.testing.assert_array_equal(scored.sum(axis=1), (~special).sum(axis=1))
    np.testing.assert_array_equal(out["mask"], ids != PAD)
    assert np.all(out["targets"][~scored] == 0)


def test_cap_keeps_a_uniform_subset():
    rng = np.random.default_rng(4)
    batch, length, cap = 4000, 10, 3
    ids = rng.integers(5, VOCAB, size=(batch, length), dtype=np.int32)
    out = _mask(ids, np.random.default_rng(5), max_predictions=cap, mask_rate=1.0)
    assert np.all(out["weights"].sum(axis=1) == cap)
    assert np.all((out["inputs"] != ids).sum(axis=1) <= cap)
    # Each position is kept with probability cap / length.
    counts = np.bincount(out["positions"].ravel(), minlength=length)
    for c in counts:
        assert _within(int(c), batch, cap / length)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mask_rate": 1.5}, "data.mask_rate"),
        ({"mask_token_rate": 0.95, "random_token_rate": 0.1}, "data.mask_token_rate"),
    ],
)
def test_bad_rates_name_the_field(kwargs, field):
    ids = np.full((1, 4), 7, np.int32)
    with pytest.raises(ValueError, match=field):
        _mask(ids, np.random.default_rng(0), max_predictions=4, **kwargs)
