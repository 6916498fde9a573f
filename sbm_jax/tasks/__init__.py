"""Task registry: ``config.task.name`` -> a builder ``config -> Task`` and a check.

A task module registers its builder with ``@register_task("name", check=...)``; importing
the module registers it. The check (``config -> None``, raising ``ValueError`` naming the
field) looks at the config only, so ``task_config_errors`` can run before any data is
read or generated. The synthetic task is built in. LRA and GLUE register theirs from
their own packages (``lra``, ``glue``), which the entry point imports; ``sbm_jax`` never
imports them. A builder that takes an ``output_dir`` keyword gets the run's directory
(e.g. to reuse the tokenizer a resumed run saved).
"""

from sbm_jax.tasks import synthetic  # the built-in task: importing it registers it
from sbm_jax.tasks.registry import (
    TaskBuilder,
    TaskCheck,
    available_tasks,
    build_task,
    register_check,
    register_task,
    task_config_errors,
)

register_check("synthetic", synthetic.check_config)

__all__ = [
    "TaskBuilder",
    "TaskCheck",
    "available_tasks",
    "build_task",
    "register_check",
    "register_task",
    "task_config_errors",
]
