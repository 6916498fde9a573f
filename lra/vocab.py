"""Fixed token vocabularies for the LRA tasks.

Every id here is a constant of the code, never derived from data, so the same token
gets the same id on every run and every machine (the original LRA built its ListOps
vocabulary from an unordered set, so ids changed between runs).

Id 0 is padding in every token vocabulary.  Pixel tasks (Image, Pathfinder) use the
raw grey value 0..255 as the token, as the reference setup does; they are never
padded (every image has exactly 1,024 pixels), and their padding mask is all True.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD_ID = 0

# ListOps ------------------------------------------------------------------------------

LISTOPS_OPERATORS: tuple[str, ...] = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_CLOSE = "]"
# id -> token.  Digits 0..9 are ids 1..10, the four operators 11..14, "]" is 15.
LISTOPS_TOKENS: tuple[str, ...] = (
    "<pad>",
    *(str(d) for d in range(10)),
    *LISTOPS_OPERATORS,
    LISTOPS_CLOSE,
)
LISTOPS_VOCAB_SIZE = len(LISTOPS_TOKENS)  # 16
LISTOPS_TOKEN_TO_ID: dict[str, int] = {tok: i for i, tok in enumerate(LISTOPS_TOKENS)}
# The release TSVs write the binarised tree with round brackets, e.g.
# "( ( ( [MAX 2 ) 9 ) ] )".  They carry no information beyond the operator/"]" tokens
# (the tree is fully determined by prefix order), so the encoder drops them; the
# generator's length bound counts exactly the tokens that remain.
LISTOPS_IGNORED_TOKENS = frozenset({"(", ")"})


def encode_listops(source: str) -> np.ndarray:
    """Encodes a whitespace-separated ListOps expression.

    Args:
      source: e.g. "[MAX 2 9 [MIN 4 7 ] 0 ]" or the bracketed release form.

    Returns:
      int32 [num_tokens] token ids (round brackets dropped).

    Raises:
      ValueError: naming the first token that is not in the vocabulary.
    """
    ids = []
    for tok in source.split():
        if tok in LISTOPS_IGNORED_TOKENS:
            continue
        try:
            ids.append(LISTOPS_TOKEN_TO_ID[tok])
        except KeyError:
            raise ValueError(
                f"unknown ListOps token {tok!r}; allowed: {LISTOPS_TOKENS[1:]} and '(' ')'"
            ) from None
        if ids[-1] == PAD_ID:
            raise ValueError("ListOps source contains the padding token '<pad>'")
    return np.asarray(ids, dtype=np.int32)


def check_listops_expression(source: str) -> None:
    """Checks that ``source`` is one balanced, complete ListOps expression.

    Round brackets must balance (never close more than are open); in the operator
    tokens, every ``[OP`` must be closed by a ``]`` after at least one argument, no
    ``]`` may close nothing, and nothing may follow the end of the expression.

    Raises:
      ValueError: naming the problem and the token position (1-based, brackets counted).
    """
    round_depth = 0
    stack: list[int] = []  # arguments seen by each open operator
    done = False
    tokens = source.split()
    for position, tok in enumerate(tokens, start=1):
        if tok == "(":
            round_depth += 1
            continue
        if tok == ")":
            round_depth -= 1
            if round_depth < 0:
                raise ValueError(f"')' at token {position} closes no '('")
            continue
        if done:
            raise ValueError(f"token {tok!r} at {position} follows the end of the expression")
        if tok == LISTOPS_CLOSE:
            if not stack:
                raise ValueError(f"']' at token {position} closes no operator")
            if stack.pop() == 0:
                raise ValueError(f"the operator closed at token {position} has no arguments")
            if stack:
                stack[-1] += 1
            else:
                done = True
        elif tok in LISTOPS_OPERATORS:
            stack.append(0)
        else:
            if stack:
                stack[-1] += 1
            else:
                done = True  # a lone digit is a complete expression
    if stack:
        raise ValueError(f"{len(stack)} operator(s) left open at the end (missing ']')")
    if round_depth:
        raise ValueError(f"{round_depth} '(' left open at the end")
    if not done:
        raise ValueError("no expression")


def decode_listops(ids: Sequence[int] | np.ndarray) -> str:
    """Inverse of `encode_listops` (padding ids are skipped)."""
    return " ".join(LISTOPS_TOKENS[int(i)] for i in ids if int(i) != PAD_ID)


# Bytes (Text, Retrieval) -----------------------------------------------------------------

BYTE_OFFSET = 1  # byte b -> token b + 1, so 0 stays padding (as tfds ByteTextEncoder)
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET  # 257


def encode_bytes(data: bytes, max_length: int | None = None) -> np.ndarray:
    """UTF-8 (or any) bytes -> int32 [min(len, max_length)] token ids in 1..256."""
    if max_length is not None:
        data = data[:max_length]
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + BYTE_OFFSET


def decode_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    """Inverse of `encode_bytes` (padding ids are skipped)."""
    arr = np.asarray(ids, dtype=np.int64)
    arr = arr[arr != PAD_ID] - BYTE_OFFSET
    return arr.astype(np.uint8).tobytes()


# Pixels (Image, Pathfinder) --------------------------------------------------------------

PIXEL_VOCAB_SIZE = 256
