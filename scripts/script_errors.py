"""One-line user errors for the absl-based scripts: ``error: ...`` on stderr and exit
status 2, as ``scripts/train.py`` does, instead of absl's flag help and status 1."""

from __future__ import annotations

import sys
from typing import NoReturn

from absl import flags

USAGE_EXIT = 2


def exit_with_error(message: str) -> NoReturn:
    """Print ``error: <message>`` (on one line) to stderr and exit with status 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT)


def parse_flags_or_exit(argv: list[str]) -> list[str]:
    """``app.run``'s ``flags_parser``: absl's parsing, a bad flag in one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        exit_with_error(str(e))
