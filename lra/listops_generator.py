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

Sizes that cannot be met fail fast instead of looping forever: ``count_expressions``
counts the distinct expressions the parameters allow (exactly, by dynamic programming
over tree sizes), and ``generate_split`` refuses a split larger than that count; a
split that keeps drawing duplicates, or lengths that are possible but practically never
drawn, stop with an error after a bounded number of draws.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Collection, Iterator

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


# Bounds on the draws behind one example (far above what any feasible setting needs:
# LRA's lengths accept about one tree in 20).
MAX_DRAWS_PER_EXAMPLE = 1_000_000
MAX_DUPLICATES_PER_EXAMPLE = 20_000


def count_expressions(params: ListOpsParams, cap: int = 2**62) -> int:
    """The number of distinct expressions with ``min_length < length < max_length``
    that the generator can draw, or ``cap`` if there are at least that many.

    Trees are counted by token count: a subtree at depth ``d`` is one of 10 digits (one
    token) or, while ``d < max_depth``, one of 4 operators with 2..``max_args``
    children, ``2 + sum(children)`` tokens. Prefix order with closing ``]`` tokens makes
    distinct trees distinct token sequences.
    """
    size = params.max_length  # lengths 0 .. max_length - 1
    cap_f = float(cap)
    subtree = np.zeros(size)
    subtree[1] = 10.0  # depth max_depth: digits only
    for _ in range(params.max_depth - 1):  # depths max_depth - 1 .. 1
        children = np.zeros(size)
        power = subtree.copy()
        for _k in range(2, params.max_args + 1):
            power = np.minimum(np.convolve(power, subtree)[:size], cap_f)
            children = np.minimum(children + power, cap_f)
        level = np.zeros(size)
        level[1] = 10.0
        level[2:] = np.minimum(4.0 * children[: size - 2], cap_f)
        subtree = level
    total = float(np.sum(subtree[params.min_length + 1 : params.max_length]))
    return int(min(total, cap_f))


def check_sizes(params: ListOpsParams, sizes: dict[str, int]) -> None:
    """Raise ``ValueError`` when the splits together ask for more distinct expressions
    than the parameters allow (``count_expressions``): no expression is in two splits."""
    total = sum(max(0, n) for n in sizes.values())
    if total <= 0:
        return
    available = count_expressions(params, cap=total)
    if available < total:
        asked = " + ".join(f"{n} {split}" for split, n in sizes.items() if n > 0)
        raise ValueError(
            f"ListOps cannot give {total} distinct examples ({asked}) with "
            f"{params.min_length} < length < {params.max_length} (max_depth="
            f"{params.max_depth}, max_args={params.max_args}): only {available} such "
            "expressions exist; widen the lengths or ask for fewer examples"
        )


def expression_digest(ids: np.ndarray) -> bytes:
    """The key under which duplicates are found: a hash of the token ids."""
    return hashlib.blake2b(np.asarray(ids, np.int32).tobytes(), digest_size=16).digest()


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


def evaluate(ids: np.ndarray) -> int:
    """The value of the expression of token ids ``ids`` (as ``vocab.encode_listops``
    gives them; a well-formed expression, ``vocab.check_listops_expression``)."""
    stack: list[list[int]] = [[]]
    ops: list[int] = []
    for token in np.asarray(ids).tolist():
        if token in _OP_IDS:
            ops.append(_OP_IDS.index(token))
            stack.append([])
        elif token == _CLOSE_ID:
            args = stack.pop()
            stack[-1].append(_apply(ops.pop(), args))
        else:
            stack[-1].append(_DIGIT_IDS.index(token))
    return stack[0][0]


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
    for _ in range(MAX_DRAWS_PER_EXAMPLE):
        out: list[int] = []
        try:
            value = _draw_node(rng, 1, params, out)
        except _TooLong:
            continue
        if params.min_length < len(out) < params.max_length:
            return np.asarray(out, dtype=np.int32), value
    raise ValueError(
        f"no ListOps tree with {params.min_length} < length < {params.max_length} in "
        f"{MAX_DRAWS_PER_EXAMPLE} draws (max_depth={params.max_depth}): such lengths are "
        "possible but practically never drawn; widen the lengths"
    )


#: The order in which generated splits exclude one another: an expression of a split
#: is never one of a split before it.
SPLIT_ORDER = ("train", "validation", "test")


def earlier_digests(
    params: ListOpsParams,
    *,
    seed: int,
    sizes: dict[str, int],
    split: str,
    cache: dict[str, frozenset[bytes]] | None = None,
) -> frozenset[bytes]:
    """The digests of the splits before ``split`` in :data:`SPLIT_ORDER`: what
    ``split`` must not repeat (``generate_split(..., exclude=...)``), as the LRA
    reference drops duplicates over the whole set before splitting it.

    ``cache`` maps a split to its digests; a split not in it is generated (with its own
    exclusions) and added. A builder that records each split's digests as it writes
    them, in this order, generates nothing twice.
    """
    if split not in SPLIT_ORDER:
        raise ValueError(f"split must be one of {SPLIT_ORDER}, got {split!r}")
    cache = {} if cache is None else cache
    out: set[bytes] = set()
    for earlier in SPLIT_ORDER[: SPLIT_ORDER.index(split)]:
        if sizes.get(earlier, 0) <= 0:
            continue
        if earlier not in cache:
            exclude = earlier_digests(params, seed=seed, sizes=sizes, split=earlier, cache=cache)
            examples = generate_split(
                params, seed=seed, split=earlier, num_examples=sizes[earlier], exclude=exclude
            )
            cache[earlier] = frozenset(expression_digest(ids) for _, ids, _ in examples)
        out |= cache[earlier]
    return frozenset(out)


def example_rng(seed: int, split: str, index: int) -> random.Random:
    """The private random stream of one example."""
    return random.Random(f"lra-listops/{seed}/{split}/{index}")


def generate_split(
    params: ListOpsParams,
    *,
    seed: int,
    split: str,
    num_examples: int,
    exclude: Collection[bytes] = (),
) -> Iterator[tuple[int, np.ndarray, int]]:
    """Yields (index, token ids int32 [length], label) for one split, without duplicates.

    A duplicate of an earlier example of the same split, or an expression whose
    :func:`expression_digest` is in ``exclude`` (the earlier splits' examples, so that
    no test expression is also a training one), is redrawn from the same example
    stream, so the output is still a pure function of (params, seed, split, exclude).
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    check_sizes(params, {split: num_examples, "excluded": len(exclude)})
    excluded = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
    seen: set[bytes] = set()
    for index in range(num_examples):
        rng = example_rng(seed, split, index)
        for _ in range(MAX_DUPLICATES_PER_EXAMPLE):
            ids, label = sample_expression(rng, params)
            digest = expression_digest(ids)
            if digest not in seen and digest not in excluded:
                break
        else:
            raise ValueError(
                f"ListOps example {index} of split {split!r}: {MAX_DUPLICATES_PER_EXAMPLE} "
                f"draws in a row repeated earlier examples or ones of earlier splits "
                f"({params.min_length} < length < "
                f"{params.max_length}); widen the lengths or ask for fewer examples"
            )
        seen.add(digest)
        yield index, ids, label
