"""Clean-room ListOps generator (Nangia & Bowman 2018, LRA variant).

The published procedure, as used for LRA: a random expression tree over single digits
0..9 and the operators MIN, MAX, MED (median, rounded down) and SM (sum modulo 10).
Starting at depth 1, a node is an operator with probability 0.25 (the reference
script's constant ``VALUE_P``: despite the name it is the probability of *not* drawing
a value) as long as its depth is below ``max_depth``, else a digit drawn uniformly.
An operator node has 2..``max_args`` children (uniform) and one operator drawn
uniformly.  Written in prefix order, ``[OP a b c ]``, every operator contributes two
tokens (itself and ``]``) and every digit one.  Trees whose token count lies strictly
between ``min_length`` and ``max_length`` are kept (500 and 2000 in LRA), and
duplicates are dropped.  The label is the value of the root (10 classes).

Determinism: example ``i`` of split ``s`` draws from its own ``random.Random`` seeded
with the string ``"lra-listops/{seed}/{s}/{i}"`` (string seeding hashes with SHA-512
and is stable across Python versions and platforms), so any example can be
regenerated alone and generation is reproducible byte for byte.

Generation aborts a tree as soon as it reaches ``max_length`` tokens.  This changes
nothing about the accepted trees' distribution (the acceptance event is the same, and
the next attempt is a fresh draw), it only saves time on huge rejected trees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterator

import numpy as np

from lra import vocab

_OPS = vocab.LISTOPS_OPERATORS
_OP_IDS = tuple(vocab.LISTOPS_TOKEN_TO_ID[op] for op in _OPS)
_DIGIT_IDS = tuple(vocab.LISTOPS_TOKEN_TO_ID[str(d)] for d in range(10))
_CLOSE_ID = vocab.LISTOPS_TOKEN_TO_ID[vocab.LISTOPS_CLOSE]


@dataclasses.dataclass(frozen=True)
class ListOpsParams:
    """Generation parameters; defaults are LRA's.

    Lengths are token counts without round brackets, and both bounds are exclusive, as
    in the reference script (``min_length < length < max_length``).
    """

    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    operator_prob: float = 0.25

    def __post_init__(self):
        if not 0 <= self.min_length < self.max_length - 1:
            raise ValueError(
                f"ListOpsParams: need 0 <= min_length < max_length - 1, got "
                f"min_length={self.min_length}, max_length={self.max_length}"
            )
        if self.max_depth < 2:
            raise ValueError(f"ListOpsParams.max_depth must be >= 2, got {self.max_depth}")
        if self.max_args < 2:
            raise ValueError(f"ListOpsParams.max_args must be >= 2, got {self.max_args}")
        if not 0.0 < self.operator_prob < 1.0:
            raise ValueError(
                f"ListOpsParams.operator_prob must be in (0, 1), got {self.operator_prob}"
            )


class _TooLong(Exception):
    pass


def _apply(op_index: int, args: list[int]) -> int:
    op = _OPS[op_index]
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        s = sorted(args)
        k = len(s)
        return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) // 2
    return sum(args) % 10  # "[SM"


def _draw_node(rng: random.Random, depth: int, p: ListOpsParams, out: list[int]) -> int:
    """Appends one subtree's token ids to `out` and returns its value."""
    if len(out) >= p.max_length:
        raise _TooLong
    if depth < p.max_depth and rng.random() < p.operator_prob:
        op_index = rng.randrange(len(_OPS))
        num_args = rng.randint(2, p.max_args)
        out.append(_OP_IDS[op_index])
        args = [_draw_node(rng, depth + 1, p, out) for _ in range(num_args)]
        out.append(_CLOSE_ID)
        return _apply(op_index, args)
    digit = rng.randrange(10)
    out.append(_DIGIT_IDS[digit])
    return digit


def sample_expression(rng: random.Random, params: ListOpsParams) -> tuple[np.ndarray, int]:
    """Draws trees until one has an accepted length.

    Returns:
      (token ids int32 [length], label in 0..9).
    """
    while True:
        out: list[int] = []
        try:
            value = _draw_node(rng, 1, params, out)
        except _TooLong:
            continue
        if params.min_length < len(out) < params.max_length:
            return np.asarray(out, dtype=np.int32), value


def example_rng(seed: int, split: str, index: int) -> random.Random:
    """The private random stream of one example."""
    return random.Random(f"lra-listops/{seed}/{split}/{index}")


def generate_split(
    params: ListOpsParams, *, seed: int, split: str, num_examples: int
) -> Iterator[tuple[int, np.ndarray, int]]:
    """Yields (index, token ids int32 [length], label) for one split, without duplicates.

    A duplicate of an earlier example of the same split is redrawn from the same
    example stream, so the output is still a pure function of (params, seed, split).
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    seen: set[bytes] = set()
    for index in range(num_examples):
        rng = example_rng(seed, split, index)
        while True:
            ids, label = sample_expression(rng, params)
            digest = hashlib.blake2b(ids.tobytes(), digest_size=16).digest()
            if digest not in seen:
                break
        seen.add(digest)
        yield index, ids, label
