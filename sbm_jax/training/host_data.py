"""Host-side batches: gradient-accumulation layout, the rows each process feeds, and
the global device arrays assembled from them.

Batch layout: a global batch of ``B`` rows is split into ``A`` micro-batches of ``B / A``
rows (rows ``i*B/A .. (i+1)*B/A - 1`` form micro-batch ``i``); each micro-batch is split
over the mesh's ``data`` axis. ``A`` is the smallest count that keeps every device at or
under ``train.max_per_device_batch`` examples per pass.

Multi-process (``jax.process_count() > 1``): each process feeds only the rows of every
global batch that land on its devices (``process_train_rows``): the task's
``process_train_batches(start, rows)`` reads just those (LRA does), otherwise they are cut
from ``train_batches``. The global arrays are assembled with
``jax.make_array_from_process_local_data``; the global batch, and so every loss, is the
same as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from sbm_jax.training.errors import ConfigError
from sbm_jax.training.sharding import DATA_AXIS, data_axis_size
from sbm_jax.training.steps import micro_batch_sharding
from sbm_jax.training.task import Batch, Task

Array = jax.Array


def accumulation_steps(batch_size: int, num_devices: int, max_per_device: int) -> int:
    """Micro-batches per optimizer step so that each device sees at most
    ``max_per_device`` examples per pass (0: no limit).

    Returns the smallest ``A`` with ``batch_size % (A * num_devices) == 0`` and
    ``batch_size / (A * num_devices) <= max_per_device``.

    Raises:
      ConfigError naming train.batch_size (not a multiple of the devices) or
      train.max_per_device_batch (negative).
    """
    if batch_size % num_devices:
        raise ConfigError(
            f"train.batch_size={batch_size} is not a multiple of the {num_devices} devices"
        )
    if max_per_device < 0:
        raise ConfigError(f"train.max_per_device_batch={max_per_device} must be >= 0")
    if max_per_device == 0:
        return 1
    per_device = batch_size // num_devices
    for accum in range(1, per_device):
        if per_device % accum == 0 and per_device // accum <= max_per_device:
            return accum
    return per_device  # one example per device per pass always fits


def split_micro_batches(batch: Batch, accum: int) -> dict[str, np.ndarray]:
    """Host batch [B, ...] -> [accum, B / accum, ...] (micro-batch i = rows i*B/A..)."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.shape[0] % accum:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, not divisible by {accum}")
        out[key] = value.reshape(accum, value.shape[0] // accum, *value.shape[1:])
    return out


def process_train_rows(batch_size: int, accum: int, mesh: Mesh) -> np.ndarray:
    """Rows of a global batch that this process feeds, in its local batch's order.

    The global batch [B] becomes [A, B / A] (``split_micro_batches``) sharded as
    ``micro_batch_sharding``; this process's devices hold columns ``c0..c1`` of every
    micro-batch, i.e. global rows ``i * B / A + c`` for ``i < A``, ``c0 <= c < c1``, listed
    micro-batch by micro-batch (so the local rows reshape to [A, c1 - c0]). One process:
    ``arange(B)``. The rows are split over the mesh's ``data`` axis only: devices that
    differ only in their ``heads`` coordinate hold the same rows.

    Raises:
      ConfigError naming train.batch_size when the rows do not split over the devices.
    """
    if batch_size % accum:
        raise ConfigError(f"train.batch_size={batch_size} is not a multiple of {accum} passes")
    micro = batch_size // accum
    data = data_axis_size(mesh)
    if micro % data:
        raise ConfigError(
            f"train.batch_size={batch_size} / {accum} passes is not a multiple of the "
            f"{data} devices of the mesh's data axis"
        )
    indices = micro_batch_sharding(mesh).addressable_devices_indices_map((accum, micro))
    cols: set[int] = set()
    for index in indices.values():
        cols.update(range(*index[1].indices(micro)))  # type: ignore[index]
    ordered = sorted(cols)
    if ordered != list(range(ordered[0], ordered[-1] + 1)):
        raise ValueError(f"this process's devices hold non-contiguous batch rows {ordered}")
    return np.asarray([i * micro + c for i in range(accum) for c in ordered], np.int64)


def train_source(task: Task, rows: np.ndarray) -> Callable[[int], Iterator[Batch]]:
    """``start_step -> iterator`` of this process's rows ``rows`` of every batch."""
    if jax.process_count() == 1:
        return task.train_batches
    process_batches = task.process_train_batches
    if process_batches is not None:

        def source(start: int) -> Iterator[Batch]:
            return process_batches(start, rows)

        return source

    def cut(start: int) -> Iterator[Batch]:
        for batch in task.train_batches(start):
            yield {k: np.asarray(v)[rows] for k, v in batch.items()}

    return cut


def put_global(tree: Any, sharding: Any) -> Any:
    """Host values (the same in every process) -> global arrays with ``sharding`` (one
    ``NamedSharding`` for every leaf, or a pytree of them shaped like ``tree``)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def one(x: Any, leaf_sharding: NamedSharding) -> Array:
        if isinstance(x, jax.Array) and x.sharding == leaf_sharding:
            return x
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, leaf_sharding, lambda idx: value[idx])

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, sharding), tree)  # type: ignore[arg-type]
    return jax.tree.map(one, tree, sharding)


def _local_data_slices(mesh: Mesh) -> int:
    """How many positions of the mesh's ``data`` axis this process has a device in."""
    names = list(mesh.axis_names)
    devices = mesh.devices
    if DATA_AXIS in names:
        devices = np.moveaxis(devices, names.index(DATA_AXIS), 0)
    rows = devices.reshape(devices.shape[0], -1) if devices.ndim else devices.reshape(1, 1)
    me = jax.process_index()
    return sum(any(d.process_index == me for d in row) for row in rows)


def put_micro_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, Array]:
    """This process's rows [A, micro_local, ...] -> global [A, micro, ...] arrays."""
    sharding = micro_batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    per_process = {v.shape[1] for v in local.values()}
    if len(per_process) != 1:
        raise ValueError(f"batch entries disagree on their rows: {sorted(per_process)}")
    micro = data_axis_size(mesh) * per_process.pop() // _local_data_slices(mesh)
    return {
        key: jax.make_array_from_process_local_data(
            sharding, value, (value.shape[0], micro, *value.shape[2:])
        )
        for key, value in local.items()
    }
