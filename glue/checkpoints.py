"""Minimal orbax checkpoints of pretrained parameters (with JSON metadata).

Written here because the shared trainer's checkpointing (``sbm_jax.training``) was not
yet available; fine-tuning needs only the parameters and the model config, so that is
what is stored: ``<dir>/<step>/{params, meta}``.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


def save_params(directory: str, step: int, params: Any, meta: dict[str, Any]) -> str:
    """Save ``params`` and JSON ``meta`` as step ``step`` under ``directory``; returns it."""
    directory = os.path.abspath(directory)
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    manager.save(
        step,
        args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()
    return directory


def find_checkpoint_dir(path: str, flag: str = "--init_checkpoint") -> str:
    """The orbax directory for ``path``: a pretraining run directory (holding
    ``checkpoints/``) or the checkpoint directory itself. Errors name ``flag``."""
    if not path:
        raise ValueError(f"{flag} is required (a pretraining output directory)")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag}={path!r} does not exist")
    nested = os.path.join(path, CHECKPOINT_DIR)
    candidate = nested if os.path.isdir(nested) else path
    if not any(name.isdigit() for name in os.listdir(candidate)):
        raise FileNotFoundError(f"{flag}={path!r} holds no checkpoint steps")
    return candidate


def restore_params(
    directory: str, flag: str = "--init_checkpoint"
) -> tuple[Any, dict[str, Any], int]:
    """(params as nested dicts of arrays, meta dict, step) of the latest step."""
    manager = ocp.CheckpointManager(os.path.abspath(directory))
    step = manager.latest_step()
    if step is None:
        raise FileNotFoundError(f"{flag}={directory!r} holds no checkpoint steps")
    restored = manager.restore(
        step,
        args=ocp.args.Composite(params=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
    )
    manager.close()
    return restored["params"], dict(restored["meta"]), int(step)
