"""Start-up checks of a training config; every message names the offending field.

Decisions:
* ``model.num_heads * model.head_dim`` must equal ``model.emb_dim``. Every mechanism
  projects its heads back to ``emb_dim`` itself, so another width would run, but the
  paper's settings (and every preset here) use heads x head_dim = width and a mismatch
  is far more often a typo than a choice.
* ``train.batch_size`` must be a multiple of ``jax.device_count()`` (the batch axis is
  split evenly over the mesh's ``data`` axis).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from sbm_jax.attention import get_attention
from sbm_jax.models import HEAD_KINDS, POOLING_MODES, model_dtype


class ConfigError(ValueError):
    """A config field holds a bad value; the message names the field(s)."""


def _positive_int(errors: list[str], section: Any, prefix: str, name: str) -> None:
    value = section.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        errors.append(f"{prefix}.{name}={value!r} must be a positive integer")


def _rate(errors: list[str], section: Any, prefix: str, name: str) -> None:
    value = section.get(name)
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        errors.append(f"{prefix}.{name}={value!r} must be a rate in [0, 1)")


def check_model(model: Any, errors: list[str]) -> None:
    """Append a message per bad ``model.*`` field to ``errors``."""
    for name in (
        "vocab_size",
        "max_len",
        "emb_dim",
        "num_layers",
        "num_heads",
        "head_dim",
        "mlp_dim",
        "num_classes",
    ):
        _positive_int(errors, model, "model", name)
    if "classifier_dim" in model:
        _positive_int(errors, model, "model", "classifier_dim")
    _rate(errors, model, "model", "dropout")
    _rate(errors, model, "model", "attention_dropout")
    heads, head_dim, emb_dim = model.get("num_heads"), model.get("head_dim"), model.get("emb_dim")
    if all(isinstance(v, int) and v > 0 for v in (heads, head_dim, emb_dim)):
        if heads * head_dim != emb_dim:
            errors.append(
                f"model.head_dim={head_dim} times model.num_heads={heads} is {heads * head_dim}, "
                f"but must equal model.emb_dim={emb_dim}"
            )
    for name in ("remat", "scaled_residual_init"):  # optional flags, default False
        if not isinstance(model.get(name, False), bool):
            errors.append(f"model.{name}={model.get(name)!r} must be True or False")
    if model.get("pooling") not in POOLING_MODES:
        errors.append(f"model.pooling={model.get('pooling')!r} must be one of {POOLING_MODES}")
    try:
        model_dtype(str(model.get("dtype", "float32")))
    except ValueError as e:
        errors.append(str(e))
    try:
        cls = get_attention(str(model.get("attention")), field="model.attention")
    except ValueError as e:
        errors.append(str(e))
        return
    options = model.get("attention_options") or {}
    known = set(getattr(cls, "__dataclass_fields__", {})) - {
        "parent",
        "name",
        "num_heads",
        "head_dim",
        "out_dim",
        "attention_dropout",
        "dtype",
    }
    for key in options:
        if key not in known:
            errors.append(
                f"model.attention_options.{key} is not an option of attention "
                f"{model.attention!r}; its options are {sorted(known)}"
            )


def check_train(train: Any, device_count: int, errors: list[str]) -> None:
    """Append a message per bad ``train.*`` field to ``errors``."""
    for name in ("batch_size", "num_steps", "log_every"):
        _positive_int(errors, train, "train", name)
    batch = train.get("batch_size")
    if isinstance(batch, int) and batch > 0 and batch % device_count:
        errors.append(
            f"train.batch_size={batch} is not a multiple of the device count {device_count} "
            "(the batch is split evenly over devices)"
        )
    lr = train.get("learning_rate")
    if not isinstance(lr, (int, float)) or lr <= 0:
        errors.append(f"train.learning_rate={lr!r} must be a positive number")
    warmup, steps = train.get("warmup_steps"), train.get("num_steps")
    if not isinstance(warmup, int) or warmup < 0:
        errors.append(f"train.warmup_steps={warmup!r} must be a non-negative integer")
    elif isinstance(steps, int) and warmup > steps:
        errors.append(f"train.warmup_steps={warmup} exceeds train.num_steps={steps}")
    factor = train.get("end_learning_rate_factor")
    if not isinstance(factor, (int, float)) or not 0.0 <= factor <= 1.0:
        errors.append(f"train.end_learning_rate_factor={factor!r} must lie in [0, 1]")
    for name in ("weight_decay", "density_lambda", "grad_clip_norm"):
        value = train.get(name)
        if not isinstance(value, (int, float)) or value < 0:
            errors.append(f"train.{name}={value!r} must be a non-negative number")
    for name in ("b1", "b2"):
        _rate(errors, train, "train", name)
    eval_every = train.get("eval_every", 0)
    if not isinstance(eval_every, int) or eval_every < 0:
        errors.append(f"train.eval_every={eval_every!r} must be a non-negative integer")


def validate_config(
    config: Any,
    *,
    known_tasks: Iterable[str] | None = None,
    head: str | None = None,
    device_count: int | None = None,
) -> None:
    """Raise ``ConfigError`` listing every bad field of ``config`` (task, model, train).

    Args:
      config: the full training config (``task``, ``model``, ``train`` sections).
      known_tasks: registered task names; ``task.name`` must be one of them if given.
      head: the head the task asks for; checked against the known head kinds.
      device_count: devices the batch is split over (default ``jax.device_count()``).
    """
    import jax

    errors: list[str] = []
    for section in ("task", "model", "train"):
        if section not in config:
            errors.append(f"config has no {section!r} section")
    if errors:
        raise ConfigError("; ".join(errors))
    if known_tasks is not None:
        known = sorted(known_tasks)
        if config.task.get("name") not in known:
            errors.append(
                f"task.name={config.task.get('name')!r} is not a known task; choose one of {known}"
            )
    if head is not None and head not in HEAD_KINDS:
        errors.append(f"task head {head!r} is not one of {HEAD_KINDS}")
    check_model(config.model, errors)
    check_train(config.train, jax.device_count() if device_count is None else device_count, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def prepare_output_dir(path: str) -> str:
    """Create ``path`` (and parents); a failure raises ``ConfigError`` naming output_dir."""
    if not path:
        raise ConfigError("output_dir is empty")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir={path!r} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"output_dir={path!r} is not writable")
    return path
