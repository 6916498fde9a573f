"""One-line user errors for the command-line scripts under ``scripts/``.

A user mistake (a bad flag value, a missing or malformed file) is one line on stderr,
``error: ...`` naming the flag or the file, and exit status 2, as ``scripts/train.py``
does (``sbm_jax/training/cli.py``); never a traceback, nor a page of flag help before
the message. Two front ends:

* :func:`run` replaces ``absl.app.run`` for the absl scripts: flag parse errors (an
  unknown flag, a value that is not an integer, a failed validator) and
  ``absl.app.UsageError`` / :class:`UsageError` raised by ``main`` become that line.
* :class:`ArgumentParser` is ``argparse.ArgumentParser`` whose ``error`` writes that
  line (argparse prints the usage line first and names the program).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

USAGE_EXIT = 2


class UsageError(Exception):
    """A user mistake: :func:`run` prints ``error: <message>`` and exits with status 2."""


def fail(message: object) -> NoReturn:
    """``error: <message>`` (on one line) on stderr, then exit status 2."""
    sys.stderr.write(f"error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    raise SystemExit(USAGE_EXIT)


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> None:
    """``absl.app.run(main)`` with every user error one line and exit status 2."""
    from absl import app, flags

    def parse(args: list[str]) -> list[str]:
        try:
            return flags.FLAGS(args)
        except flags.Error as err:
            fail(err)

    def checked_main(args: list[str]) -> Any:
        try:
            return main(args)
        except (app.UsageError, UsageError) as err:
            fail(err)

    app.run(checked_main, argv=None if argv is None else list(argv), flags_parser=parse)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``error: ...``, status 2."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def output_file(flag: str, path: str, suffix: str = "") -> str:
    """The file that ``--flag=path`` is written to, checked before any work: ``path``
    with ``suffix`` added when it has no extension (what matplotlib's ``savefig`` writes
    then, so the printed path is the file written); a :class:`UsageError` when it is a
    directory or its folder does not exist."""
    if not path:
        raise UsageError(f"--{flag} is empty; give a file name")
    if os.path.isdir(path):
        raise UsageError(f"--{flag}={path!r} is a directory; give a file name inside it")
    if suffix and not os.path.splitext(path)[1]:
        path += suffix
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--{flag}={path!r}: folder {folder!r} does not exist")
    return path


def image_file(flag: str, path: str) -> str:
    """:func:`output_file` for a matplotlib figure: ``.png`` added when ``path`` has no
    extension, and an extension matplotlib cannot write refused."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = output_file(flag, path, ".png")
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1][1:].lower()
    if ext not in kinds:
        raise UsageError(
            f"--{flag}={path!r}: matplotlib cannot write .{ext} files (use one of "
            + ", ".join(f".{k}" for k in kinds)
            + ")"
        )
    return path
