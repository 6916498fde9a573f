"""What one training step costs, known before any work: the query-key pairs its
attention scores, and XLA's memory and FLOPs estimates of the train step compiled on
abstract state (nothing trained, nothing written). The command line refuses a step that
cannot fit the device (or a batch the host cannot hold) in one line, and ``--dry_run``
prints the estimate."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from sbm_jax.training.checkpoints import abstract_state
from sbm_jax.training.context import RunSettings
from sbm_jax.training.host_data import (
    process_train_rows,
    put_global,
    put_micro_batch,
    split_micro_batches,
    train_source,
)
from sbm_jax.training.sharding import mesh_from_config, state_sharding
from sbm_jax.training.state import create_train_state
from sbm_jax.training.steps import compiled_steps, replicated
from sbm_jax.training.task import Task, build_task_model


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else str(text)


#: Query-key pairs per step (batch x heads x layers x length^2) above which a run has
#: its train step compiled on abstract state before any work, to refuse one that cannot
#: fit in memory (``--dry_run`` always does it): far above any test or CPU preset.
LARGE_STEP_PAIRS = 2**34


def _length(config: Any) -> tuple[str, int]:
    """The field that sets the sequence length, and the longest input length."""
    task, model = config.get("task") or {}, config.model
    for name in ("seq_len", "max_length", "max_seq_length"):
        value = task.get(name) if hasattr(task, "get") else None
        if isinstance(value, int) and not isinstance(value, bool):
            return f"task.{name}", int(model.get("max_len") or value)
    return "model.max_len", int(model.get("max_len") or 0)


def attention_pairs(config: Any) -> int:
    """Query-key pairs one training step scores: batch x heads x layers x length^2."""
    model = config.model
    _, length = _length(config)
    return (
        int(config.train.batch_size)
        * int(model.get("num_heads") or 1)
        * int(model.get("num_layers") or 1)
        * length
        * length
    )


def step_estimate(config: Any) -> dict[str, float] | str:
    """XLA's memory / FLOPs estimate of the compiled train step, or why there is none
    (the data is not prepared yet, the task cannot be built without writing)."""
    from sbm_jax.tasks import build_task  # the registry imports this package
    from sbm_jax.training.task import may_prepare_data

    token = may_prepare_data.set(False)
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            task = build_task(copy.deepcopy(config))
            return compiled_step_estimate(copy.deepcopy(config), task)
    except (FileNotFoundError, ValueError, ImportError, OSError) as e:
        return f"the task cannot be built without preparing its data: {_last_line(str(e))}"
    finally:
        may_prepare_data.reset(token)


def host_memory() -> float:
    """This host's physical memory in bytes; 0 when unknown."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def describe_estimate(estimate: Mapping[str, float]) -> str:
    """``"0.1 GiB per device (of 24 GiB), 3.2 GFLOPs per step (XLA's estimates)"``."""
    device = estimate.get("device_bytes") or 0
    of = f" (of {_gib(device)})" if device else ""
    flops = estimate.get("flops") or 0
    work = f", {flops / 1e9:.3g} GFLOPs per step" if flops else ""
    # XLA counts a loop's body once: the streamed attention's FLOPs are a lower bound.
    return (
        f"{_gib(estimate['memory_bytes'])} per device{of}{work} (XLA's estimates; FLOPs "
        "inside loops counted once)"
    )


#: Bytes per token of a host batch, at least: int32 ids and a bool mask.
HOST_BYTES_PER_TOKEN = 5


def host_batch_error(config: Any, host_bytes: float) -> str | None:
    """One line when a single host batch (ids and mask alone) cannot fit in the host's
    memory: the step estimate builds one such batch, so it is checked first."""
    field, length = _length(config)
    need = int(config.train.batch_size) * length * HOST_BYTES_PER_TOKEN
    if not host_bytes or need <= host_bytes:
        return None
    return (
        f"config.train.batch_size={config.train.batch_size} with config.{field}={length}: one "
        f"host batch needs at least {_gib(need)} (ids and mask), more than this host's "
        f"{_gib(host_bytes)}; lower the batch"
    )


def size_error(config: Any, estimate: Mapping[str, float]) -> str | None:
    """One line when the compiled step needs more memory than the device has."""
    need, have = estimate["memory_bytes"], estimate.get("device_bytes") or 0
    if not have or need <= have:
        return None
    field, length = _length(config)
    return (
        f"config.{field}={length} with config.train.batch_size={config.train.batch_size}: one "
        f"training step needs about {_gib(need)} per device (XLA's estimate of the compiled "
        f"step), more than the {_gib(have)} this machine's device has; shorten the sequence, "
        "lower the batch (or set train.max_per_device_batch), or use model.remat=True"
    )


def compiled_step_estimate(config: Any, task: Task) -> dict[str, float]:
    """XLA's estimate for one training step of ``config`` on ``task``, from the step
    compiled on abstract state (nothing trained, nothing written): ``memory_bytes``
    (arguments + outputs - donated aliases + temporaries, per device), ``flops`` (0 when
    the backend does not say) and ``device_bytes`` (the device's memory, 0 when unknown;
    the host's on CPU)."""
    mesh = mesh_from_config(config)
    s = RunSettings.from_config(config, mesh)
    rows = process_train_rows(s.batch_size, s.accum, mesh)
    host_batch = next(train_source(task, rows)(0))
    model = build_task_model(task, config.model)
    fresh = create_train_state(config, model, task, host_batch)
    target = abstract_state(fresh, state_sharding(fresh, mesh))
    del fresh
    batch = put_micro_batch(split_micro_batches(host_batch, s.accum), mesh)
    steps = compiled_steps(task, mesh, s.density_lambda, s.accum, s.schedule, s.halt_on_nonfinite)
    halted = (put_global(np.asarray(False), replicated(mesh)),) if s.halt_on_nonfinite else ()
    train_step, args = steps[0], (target, batch, *halted)
    jitted = train_step.jitted(target) if hasattr(train_step, "jitted") else train_step
    compiled = jitted.lower(*args).compile()
    memory = compiled.memory_analysis()
    used = 0.0
    if memory is not None:
        used = float(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    flops = float((cost or {}).get("flops", 0.0)) if isinstance(cost, Mapping) else 0.0
    return {"memory_bytes": used, "flops": max(flops, 0.0), "device_bytes": device_memory()}


def device_memory() -> float:
    """Bytes of memory of one device (its allocator's limit on GPU / TPU), the host's
    physical memory on CPU; 0 when unknown."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        return float(stats.get("bytes_limit", 0))
    return host_memory()
