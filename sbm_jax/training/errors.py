"""The trainer's error for a bad config field, in a module of its own so that any
training module can raise it without importing the config checks (which read some of
those modules: host_data's accumulation rule)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config field holds a bad value; the message names the field(s)."""
