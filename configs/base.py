"""The sections every training config shares: ``train``, ``checkpoint`` and ``mesh``.

Each config family (``configs/synthetic.py``, ``configs/lra/common.py``,
``configs/glue/pretrain.py``, ``configs/glue/finetune.py``) builds its sections here and
passes only what its task decides; a field a family does not pass keeps the default
below, written once (an optional field's, one the trainer also reads when a config
leaves it out, in ``sbm_jax/config_defaults.py``). Extra keyword arguments add family
fields (``eps``, ``num_epochs``, ``warmup_fraction``, ...) to the section; the trainer
reads a field it knows by name, so the order of fields does not matter (a run's
``config.json`` is written with sorted keys).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from sbm_jax.config_defaults import DEFAULTS


def train_section(
    *,
    batch_size: int,
    num_steps: int,
    learning_rate: float,
    warmup_steps: int = 0,
    end_learning_rate_factor: float = 1.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    grad_clip_norm: float = 0.0,
    density_lambda: float = 0.0,
    log_every: int = 10,
    eval_every: int = DEFAULTS["train.eval_every"],
    **extra: Any,
) -> ml_collections.ConfigDict:
    """``config.train``: the optimiser, its schedule and the loop's frequencies."""
    train = ml_collections.ConfigDict()
    train.batch_size = batch_size  # global examples per optimizer step
    train.num_steps = num_steps  # optimizer steps
    train.learning_rate = learning_rate  # peak learning rate
    train.warmup_steps = warmup_steps  # linear warm-up steps from 0 to the peak
    train.end_learning_rate_factor = end_learning_rate_factor  # final lr / peak (1.0: constant)
    train.weight_decay = weight_decay  # AdamW decoupled weight decay
    train.b1 = b1  # Adam beta1
    train.b2 = b2  # Adam beta2
    train.grad_clip_norm = grad_clip_norm  # global-norm gradient clipping (0: off)
    train.density_lambda = density_lambda  # mean-density regulariser weight (< 0 rewards density)
    train.log_every = log_every  # steps between host syncs (every step is still recorded)
    train.eval_every = eval_every  # steps between dev evaluations (0: only at the end)
    # examples per device per pass; more -> gradient accumulation over micro-batches (0:
    # the whole per-device share in one pass)
    train.max_per_device_batch = DEFAULTS["train.max_per_device_batch"]
    # stop with replay state on a NaN/inf loss or gradient
    train.halt_on_nonfinite = DEFAULTS["train.halt_on_nonfinite"]
    for name, value in extra.items():
        train[name] = value
    return train


def checkpoint_section(
    *, best_metric: str, best_mode: str, every_steps: int = DEFAULTS["checkpoint.every_steps"]
) -> ml_collections.ConfigDict:
    """``config.checkpoint``: when to save, how many to keep, which is the best."""
    checkpoint = ml_collections.ConfigDict()
    checkpoint.every_steps = every_steps  # steps between "latest" checkpoints (also at evals)
    checkpoint.max_to_keep = DEFAULTS["checkpoint.max_to_keep"]  # kept for resuming
    checkpoint.best_metric = best_metric  # dev metric that picks the best checkpoint
    checkpoint.best_mode = best_mode  # "max" or "min" for best_metric
    return checkpoint


def mesh_section() -> ml_collections.ConfigDict:
    """``config.mesh``: the device mesh, data-parallel by default."""
    mesh = ml_collections.ConfigDict()
    mesh.data = DEFAULTS["mesh.data"]  # devices on the data-parallel axis (-1: all / heads)
    # devices splitting the attention heads (must divide model.num_heads; per-head
    # attention parameters are sharded over them)
    mesh.heads = DEFAULTS["mesh.heads"]
    return mesh
