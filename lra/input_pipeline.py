"""grain input pipelines for the LRA tasks.

Reads a prepared TFDS dataset (array_record, no TensorFlow needed) and yields host
batches as dicts of numpy arrays:

* single-input tasks: ``inputs [B, L] int32``, ``mask [B, L] bool`` (True = real
  token), ``targets [B] int32``, ``example_mask [B] bool``;
* Retrieval: ``inputs0``, ``inputs1`` ``[B, L] int32``, ``mask0``, ``mask1``
  ``[B, L] bool``, ``targets [B] int32``, ``example_mask [B] bool``.

``example_mask`` is False only for the filler rows that complete the last evaluation
batch (so every batch has the static shape the device mesh needs); training batches
drop the remainder instead.  ``B`` is the per-host batch size: the caller sizes it for
its mesh (a multiple of the data-parallel devices on this host) and, with several
hosts, passes ``shard_index=jax.process_index(), shard_count=jax.process_count()``.

Order is a pure function of (seed, epoch): grain shuffles by index with a per-epoch
seed, and the iterator's ``get_state()`` / ``set_state()`` resume it exactly.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from lra import tasks

Batch = dict[str, np.ndarray]


def dataset_dir(data_dir: str | os.PathLike, task: str, config: str | None = None) -> str:
    """<data_dir>/<builder>/<config>/<newest version> of a prepared task dataset.

    Args:
      data_dir: the TFDS data dir that `python -m lra.prepare` wrote to.
      task: a key of `lra.tasks.TASKS`.
      config: builder config name (printed by `lra.prepare`); default: the task's
        reference config.

    Raises:
      FileNotFoundError: naming the directory and the command that prepares it.
    """
    spec = tasks.get_task(task)
    config = spec.default_config if config is None else config
    parts = [os.fspath(data_dir), spec.builder_name] + ([config] if config else [])
    base = os.path.join(*parts)
    versions = []
    if os.path.isdir(base):
        for entry in os.listdir(base):
            pieces = entry.split(".")
            if len(pieces) == 3 and all(x.isdigit() for x in pieces):
                if os.path.isfile(os.path.join(base, entry, "dataset_info.json")):
                    versions.append(tuple(int(x) for x in pieces))
    if not versions:
        raise FileNotFoundError(
            f"no prepared LRA {task!r} dataset in {base}; run "
            f"`python -m lra.prepare --task={task} --data_dir={data_dir}` first "
            "(with the same size options that named this config)"
        )
    return os.path.join(base, ".".join(str(x) for x in max(versions)))


def open_split(
    data_dir: str | os.PathLike, task: str, split: str, config: str | None = None
) -> Any:
    """Random-access source of one split ('train' | 'validation' | 'test')."""
    spec = tasks.get_task(task)
    if split not in spec.splits:
        raise ValueError(f"split must be one of {sorted(spec.splits)}, got {split!r}")
    builder = tfds.builder_from_directory(dataset_dir(data_dir, task, config))
    return builder.as_data_source(split=spec.splits[split])


def pad_tokens(tokens: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Cuts or right-pads a token sequence.

    Args:
      tokens: [n] integer ids.
      max_length: L.

    Returns:
      (ids int32 [L], mask bool [L]); padding is id 0 with mask False.
    """
    tokens = np.asarray(tokens).reshape(-1)[:max_length]
    ids = np.zeros((max_length,), dtype=np.int32)
    ids[: tokens.shape[0]] = tokens
    mask = np.zeros((max_length,), dtype=bool)
    mask[: tokens.shape[0]] = True
    return ids, mask


@dataclasses.dataclass(frozen=True)
class PadAndMask(grain.transforms.Map):
    """Stored example -> fixed-length int32 ids, bool mask, int32 target."""

    max_length: int
    dual_input: bool = False

    def map(self, element: dict[str, Any]) -> Batch:
        out: Batch = {
            "targets": np.asarray(element["targets"], dtype=np.int32),
            "example_mask": np.asarray(True),
        }
        if self.dual_input:
            for i in (0, 1):
                out[f"inputs{i}"], out[f"mask{i}"] = pad_tokens(
                    element[f"inputs{i}"], self.max_length
                )
        else:
            out["inputs"], out["mask"] = pad_tokens(element["inputs"], self.max_length)
        return out


@dataclasses.dataclass(frozen=True)
class FillBatch(grain.transforms.Map):
    """Completes a short (last) batch to `batch_size` rows with all-padding examples."""

    batch_size: int

    def map(self, batch: Batch) -> Batch:
        n = next(iter(batch.values())).shape[0]
        if n == self.batch_size:
            return batch
        out = {}
        for key, value in batch.items():
            filler = np.zeros((self.batch_size - n, *value.shape[1:]), dtype=value.dtype)
            out[key] = np.concatenate([value, filler])
        return out


def make_dataset(
    source: Any,
    *,
    task: str,
    batch_size: int,
    train: bool,
    seed: int = 0,
    max_length: int | None = None,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    worker_count: int = 0,
) -> grain.IterDataset:
    """Builds the batched pipeline over a random-access `source`.

    Args:
      source: e.g. `open_split(...)` (anything with __len__ and __getitem__ that
        returns stored examples).
      task: a key of `lra.tasks.TASKS`.
      batch_size: rows per host batch B.
      train: True: shuffle (per-epoch reshuffle), repeat `num_epochs` (None = forever),
        drop the remainder.  False: file order, one pass, last batch filled up.
      seed: shuffle seed in [0, 2**32).
      max_length: L; default the task's reference length.  Longer sequences are cut.
      num_epochs: passes over the data when training (None = endless).
      shard_index, shard_count: this host's share of the examples (strided).
      worker_count: > 0 runs the transforms in that many worker processes.

    Returns:
      A grain IterDataset; `iter()` of it has `get_state()` / `set_state()`.
    """
    spec = tasks.get_task(task)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    length = spec.max_length if max_length is None else max_length
    if length < 1:
        raise ValueError(f"max_length must be >= 1, got {length}")
    ds = grain.MapDataset.source(source)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    if train:
        ds = ds.shuffle(seed=seed).repeat(num_epochs)
    ds = ds.map(PadAndMask(max_length=length, dual_input=spec.dual_input))
    ds = ds.batch(batch_size, drop_remainder=train)
    if not train:
        ds = ds.map(FillBatch(batch_size))
    it_ds = ds.to_iter_dataset()
    if worker_count > 0:
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return it_ds


def create_dataset(
    data_dir: str | os.PathLike,
    task: str,
    split: str,
    *,
    batch_size: int,
    config: str | None = None,
    train: bool | None = None,
    **kwargs: Any,
) -> grain.IterDataset:
    """`make_dataset(open_split(data_dir, task, split, config), ...)`; train defaults to
    split == 'train'."""
    source = open_split(data_dir, task, split, config)
    return make_dataset(
        source,
        task=task,
        batch_size=batch_size,
        train=(split == "train") if train is None else train,
        **kwargs,
    )
