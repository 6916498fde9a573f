"""The trainer's error for a bad config field, in a module of its own so that any
training module can raise it without importing the config checks (which read some of
those modules: host_data's accumulation rule)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config field holds a bad value; the message names the field(s)."""


#: What orbax / TensorStore say when a write fails for lack of space (they wrap the
#: OSError in their own error, or keep only its text).
_NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")


def is_no_space(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a full disk or quota:
    ``ENOSPC`` / ``EDQUOT``, or their text in a wrapping library's message."""
    import errno

    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in _NO_SPACE_TEXTS):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


class NoSpaceError(RuntimeError):
    """A write of the run failed for lack of space; the message names the folder. What
    was half-written (a temporary checkpoint, a cut record line) is already gone."""
