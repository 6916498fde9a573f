"""What the stages of a run share: the settings read once from the config
(``RunSettings``) and the context every stage takes (``RunContext``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from sbm_jax.config_defaults import field
from sbm_jax.training.host_data import accumulation_steps
from sbm_jax.training.sharding import data_axis_size
from sbm_jax.training.state import ScheduleArgs
from sbm_jax.training.task import Task

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The config fields the trainer reads, as plain values."""

    batch_size: int
    accum: int  # micro-batches per step (gradient accumulation)
    num_steps: int
    until: int  # the step this session stops at (``stop_after``, else ``num_steps``)
    log_every: int
    eval_every: int
    checkpoint_every: int
    max_to_keep: int
    best_metric: str
    best_mode: str
    halt_on_nonfinite: bool
    density_lambda: float
    schedule: ScheduleArgs

    @classmethod
    def from_config(cls, config: Any, mesh: Mesh, stop_after: int | None = None) -> RunSettings:
        """Every field the trainer reads, optional ones at their defaults."""
        train = config.train
        batch_size, num_steps = int(train.batch_size), int(train.num_steps)
        max_per_device = int(field(config, "train.max_per_device_batch"))
        return cls(
            batch_size=batch_size,
            accum=accumulation_steps(batch_size, data_axis_size(mesh), max_per_device),
            num_steps=num_steps,
            until=num_steps if stop_after is None else min(int(stop_after), num_steps),
            log_every=int(train.log_every),
            eval_every=int(field(config, "train.eval_every")),
            checkpoint_every=int(field(config, "checkpoint.every_steps")),
            max_to_keep=int(field(config, "checkpoint.max_to_keep")),
            best_metric=str(field(config, "checkpoint.best_metric")),
            best_mode=str(field(config, "checkpoint.best_mode")),
            halt_on_nonfinite=bool(field(config, "train.halt_on_nonfinite")),
            density_lambda=float(train.density_lambda),
            schedule=ScheduleArgs.of(train),
        )


@dataclasses.dataclass(frozen=True)
class RunContext:
    """One session of a run, as every stage sees it.

    Attributes:
      config: the config as the task resolved it; ``task``, ``mesh``, ``settings``: what
        trains, where and how.
      output_dir: the run's folder (created, locked by process 0).
      primary: whether this is process 0, the one that writes the run's files.
      log: a line on the run's log (stdout by default; only process 0 writes).
    """

    config: Any
    task: Task
    mesh: Mesh
    settings: RunSettings
    output_dir: str
    primary: bool
    log: Log
