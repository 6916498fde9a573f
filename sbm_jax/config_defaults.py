"""What an optional field of a training config means when the config leaves it out.

The one table of those defaults: ``configs/base.py`` writes them into every shipped
config, and the trainer, its config checks, the mesh and the optimizer read a field
through :func:`field` when a config (a test's, a notebook's, an older run's) lacks it.
The encoder's optional fields keep their defaults on the ``Encoder`` module itself
(``sbm_jax.models.build.ENCODER_DEFAULTS``), a mechanism's options on its module.

A leaf module (no JAX, no flax): ``configs`` imports it to build a config.
"""

from __future__ import annotations

from typing import Any

#: ``"section.field"`` -> its value when absent.
DEFAULTS: dict[str, Any] = {
    "init_from": "",  # a run or checkpoint whose parameters start this run ("": none)
    "train.eval_every": 0,  # steps between dev evaluations (0: only at the end)
    "train.max_per_device_batch": 0,  # examples per device per pass (0: no limit)
    "train.halt_on_nonfinite": True,  # stop with replay state on a NaN/inf loss or gradient
    "train.eps": 1e-8,  # Adam's epsilon (optax's default)
    "train.weight_decay_mask": "all",  # which parameters AdamW's decay shrinks
    "checkpoint.every_steps": 1000,  # steps between "latest" checkpoints (also at evals)
    "checkpoint.max_to_keep": 2,  # latest checkpoints kept for resuming
    "checkpoint.best_metric": "accuracy",  # dev metric that picks the best checkpoint
    "checkpoint.best_mode": "max",  # "max" or "min" for best_metric
    "mesh.data": -1,  # devices on the data-parallel axis (-1: all / mesh.heads)
    "mesh.heads": 1,  # devices splitting the attention heads
}


def field(config: Any, path: str) -> Any:
    """``config.<path>`` (``"checkpoint.every_steps"``), or its default from
    :data:`DEFAULTS` when the config (or the section) leaves it out."""
    node = config
    for part in path.split("."):
        if node is None or not hasattr(node, "get") or part not in node:
            return DEFAULTS[path]
        node = node.get(part)
    return node
