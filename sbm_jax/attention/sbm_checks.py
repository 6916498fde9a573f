"""SBM's own check of a training run, hung on its registry entry
(:func:`sbm_jax.attention.registry.register_config_check`): refuse, before anything is
built or compiled, attention options under which no attention path fits a batch the
run will trace (:func:`sbm_jax.attention.sbm_paths.choose_paths`' error, naming the
fields and the sizes they would need), instead of a traceback at the first step or
mid-run at the first evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sbm_jax.attention.registry import register_config_check


@register_config_check("sbm")
def check_paths(module: Any, batches: Sequence[tuple[str, int]], length: int) -> list[str]:
    """``module.paths_for`` (``SBMAttention``'s path choice) for every ``(what, rows)``
    batch; the first batch without a path is one message."""
    for what, rows in batches:
        try:
            module.paths_for(rows, length)
        except ValueError as e:
            return [f"model.attention_options for {what} of {rows} x {length}: {e}"]
    return []
