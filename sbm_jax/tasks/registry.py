"""The task registry itself (the :mod:`sbm_jax.tasks` package re-exports it).

Task modules import it from here, so that the package may import them (the built-in
synthetic task) without an import cycle.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from sbm_jax.training.task import Task

TaskBuilder = Callable[..., Task]
TaskCheck = Callable[[Any], None]

_TASKS: dict[str, TaskBuilder] = {}
_CHECKS: dict[str, TaskCheck] = {}


def register_task(
    name: str, check: TaskCheck | None = None
) -> Callable[[TaskBuilder], TaskBuilder]:
    """Decorator registering ``builder(config) -> Task`` (and its ``check``) as ``name``."""

    def wrap(builder: TaskBuilder) -> TaskBuilder:
        if name in _TASKS and _TASKS[name] is not builder:
            raise ValueError(f"task {name!r} is registered twice")
        _TASKS[name] = builder
        if check is not None:
            _CHECKS[name] = check
        return builder

    return wrap


def register_check(name: str, check: TaskCheck) -> None:
    """Attach the config check of task ``name`` (run by ``task_config_errors``)."""
    _CHECKS[name] = check


def available_tasks() -> list[str]:
    """Sorted names of the registered tasks."""
    return sorted(_TASKS)


def _unknown_name(name: Any) -> str:
    close = difflib.get_close_matches(str(name), available_tasks(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"task.name={name!r} is not a known task{hint}; choose one of {available_tasks()}"


def task_config_errors(config: Any) -> list[str]:
    """Problems of ``config.task`` (and the fields its task reads elsewhere), found
    without building the task: an unknown name, or what the task's check raises."""
    task = config.get("task") if hasattr(config, "get") else None
    name = task.get("name") if task is not None else None
    if name not in _TASKS:
        return [_unknown_name(name)]
    check = _CHECKS.get(name)
    if check is None:
        return []
    try:
        check(config)
    except (ValueError, TypeError, FileNotFoundError) as e:
        return [str(e)]
    except (AttributeError, KeyError) as e:  # a config made for another task
        field = _missing_field(e)
        return [
            f"task.name={name!r}: this config lacks {field or 'a field'} that task reads "
            f"(use a config file made for {name!r})"
        ]
    return []


def _missing_field(error: BaseException) -> str | None:
    """``config.<name>`` of the field an ml_collections lookup missed, if it says."""
    match = re.search(r"'([A-Za-z_]\w*)'", str(error))
    return f"config.{match.group(1)}" if match else None


def build_task(config: Any, output_dir: str | None = None) -> Task:
    """The task named by ``config.task.name``; an unknown name's error names that field."""
    name = config.task.get("name")
    if name not in _TASKS:
        raise ValueError(_unknown_name(name))
    builder = _TASKS[name]
    if output_dir is not None and "output_dir" in inspect.signature(builder).parameters:
        return builder(config, output_dir=output_dir)
    return builder(config)


# Task packages outside the library that register their tasks when imported, by name:
# the library never imports them otherwise (the command line and replay_nonfinite load
# them through import_task_modules).
DEFAULT_TASK_MODULES = ("lra.train_task", "glue.tasks")

# Packages of this project: a task module that fails to import one of these has a bug,
# which is raised, not skipped.
PROJECT_PACKAGES = frozenset({"sbm_jax", "lra", "glue", "configs", "scripts", "tests"})


def import_task_modules(modules: Sequence[str]) -> dict[str, str]:
    """Import ``modules`` so that their tasks register; returns ``{module: reason}`` for
    those skipped because a dependency outside the project is not installed (e.g. GLUE's
    ``tokenizers`` where only the LRA packages are), so that the other tasks still run.

    Raises:
      ModuleNotFoundError: a module of the project itself is missing (a bug).
    """
    skipped: dict[str, str] = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in PROJECT_PACKAGES or not e.name:
                raise
            skipped[module] = f"no module named {e.name!r}"
    return skipped
