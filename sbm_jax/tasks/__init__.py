"""Task registry: ``config.task.name`` -> a builder ``config -> Task``.

A task module registers its builder with ``@register_task("name")``; importing the module
registers it. The synthetic task is built in. LRA and GLUE register theirs from their own
packages (``lra``, ``glue``), which the entry point imports; ``sbm_jax`` never imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sbm_jax.training.task import Task

TaskBuilder = Callable[[Any], Task]

_TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator registering ``builder(config) -> Task`` under ``name``."""

    def wrap(builder: TaskBuilder) -> TaskBuilder:
        if name in _TASKS and _TASKS[name] is not builder:
            raise ValueError(f"task {name!r} is registered twice")
        _TASKS[name] = builder
        return builder

    return wrap


def available_tasks() -> list[str]:
    """Sorted names of the registered tasks."""
    return sorted(_TASKS)


def build_task(config: Any) -> Task:
    """The task named by ``config.task.name``; an unknown name's error names that field."""
    name = config.task.get("name")
    if name not in _TASKS:
        raise ValueError(
            f"task.name={name!r} is not a known task; choose one of {available_tasks()}"
        )
    return _TASKS[name](config)


from sbm_jax.tasks import synthetic  # noqa: E402, F401  (registers "synthetic")
