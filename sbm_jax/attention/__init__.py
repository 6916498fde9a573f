"""Attention mechanisms, each registered by the name configs use."""

from sbm_jax.attention.registry import (
    COMMON_FIELDS,
    STATS_COLLECTION,
    Mechanism,
    available,
    build_attention,
    get_attention,
    get_mechanism,
    option_defaults,
    register,
    register_config_check,
)

__all__ = [
    "COMMON_FIELDS",
    "STATS_COLLECTION",
    "Mechanism",
    "available",
    "build_attention",
    "get_attention",
    "get_mechanism",
    "option_defaults",
    "register",
    "register_config_check",
]
from sbm_jax.attention import (
    full,  # noqa: F401
    linear,  # noqa: F401
    linformer,  # noqa: F401
    local,  # noqa: F401
    nystromformer,  # noqa: F401
    performer,  # noqa: F401
    reformer,  # noqa: F401
    sbm,  # noqa: F401
    sbm_checks,  # noqa: F401
    sparse_patterns,  # noqa: F401
    tsa,  # noqa: F401
)
