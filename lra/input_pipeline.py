"""grain input pipelines for the LRA tasks.

Reads a prepared TFDS dataset (array_record, no TensorFlow needed) and yields host
batches as dicts of numpy arrays:

* single-input tasks: ``inputs [B, L] int32``, ``mask [B, L] bool`` (True = real
  token), ``targets [B] int32``, ``example_mask [B] bool``;
* Retrieval: ``inputs0``, ``inputs1`` ``[B, L] int32``, ``mask0``, ``mask1``
  ``[B, L] bool``, ``targets [B] int32``, ``example_mask [B] bool``.

``example_mask`` is False only for the filler rows that complete the last evaluation
batch (so every batch has the static shape the device mesh needs).

Training (``train_examples``): a random-access grain ``MapDataset`` of endless shuffled,
padded examples (shuffled per epoch by (seed, epoch), repeated), so the examples of any
step are found by index and a resumed run reads exactly what an uninterrupted one would.
Evaluation (``make_dataset``): file order, one pass, batched, the last batch filled up.

A sequence longer than ``max_length`` is an error (``SequenceTooLong``) unless the
caller asks to ``truncate``; ``length_report`` counts such sequences up front so that a
run can refuse or report them before it starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from lra import tasks
from lra.builders.common import LRA_RELEASE_URL

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
    data_dir = os.path.expanduser(os.fspath(data_dir))  # "~/..." as lra.prepare reads it
    parts = [data_dir, spec.builder_name] + ([config] if config else [])
    base = os.path.join(*parts)
    versions = _prepared_versions(base)
    if not versions:
        others = prepared_configs(data_dir, task)
        listed = f"; prepared there: {', '.join(others)} (task.data_config)" if others else ""
        raise FileNotFoundError(
            f"no prepared LRA {task!r} dataset in {base}{listed}; "
            f"{prepare_hint(task, config, data_dir)}"
        )
    return os.path.join(base, ".".join(str(x) for x in max(versions)))


def prepared_configs(data_dir: str | os.PathLike, task: str) -> list[str]:
    """Names of ``task``'s builder configs prepared (some version) under ``data_dir``."""
    root = os.path.join(os.path.expanduser(os.fspath(data_dir)), tasks.get_task(task).builder_name)
    if not os.path.isdir(root):
        return []
    return [
        name for name in sorted(os.listdir(root)) if _prepared_versions(os.path.join(root, name))
    ]


def _prepared_versions(folder: str) -> list[tuple[int, int, int]]:
    """The versions (``<major>.<minor>.<patch>/`` holding ``dataset_info.json``) of one
    builder config's folder; [] when it is not one."""
    versions = []
    if os.path.isdir(folder):
        for entry in os.listdir(folder):
            pieces = entry.split(".")
            if len(pieces) == 3 and all(x.isdigit() for x in pieces):
                if os.path.isfile(os.path.join(folder, entry, "dataset_info.json")):
                    versions.append(tuple(int(x) for x in pieces))
    return versions


def prepare_hint(task: str, config: str | None, data_dir: str | os.PathLike) -> str:
    """The ``lra.prepare`` command that makes ``task``'s dataset ``config``, with what it
    needs beyond the command: the release files (``--manual_dir``) for the tasks and
    configs read from the LRA release, network access for text and image (TFDS'
    ``imdb_reviews`` and ``cifar10`` are downloaded from their source hosts)."""
    flags = [f"--task={task}", f"--data_dir={data_dir}"]
    config = config or ""
    release = task == "retrieval" or config.startswith("release")
    if task in ("listops", "pathfinder") and release:
        flags.append("--source=release")
    if task == "pathfinder":
        difficulty = config.split("_")[1] if "_" in config else "hard"
        flags.append(f"--difficulty={difficulty}")
    if config.startswith("bytes") and config != tasks.get_task(task).default_config:
        flags.append(f"--max_length={config.removeprefix('bytes')}")  # bytes<N>: cut at N
    if release:
        flags.append("--manual_dir=DIR")
    hint = f"run `python -m lra.prepare {' '.join(flags)}` first"
    if release:
        hint += (
            f" (DIR: the folder holding lra_release/ from {LRA_RELEASE_URL}, unpacked with tar xzf)"
        )
    elif task in ("text", "image"):
        catalog = "imdb_reviews" if task == "text" else "cifar10"
        hint += (
            f" (it downloads TFDS {catalog!r} from its source host: it needs network access, "
            f"or --catalog_data_dir=DIR where {catalog} is already prepared)"
        )
    if "_n" in config or "_len" in config:
        hint += f"; with the size options that named {config!r} (--num_train=... --max_length=...)"
    return hint


def open_split(
    data_dir: str | os.PathLike, task: str, split: str, config: str | None = None
) -> Any:
    """Random-access source of one split ('train' | 'validation' | 'test')."""
    spec = tasks.get_task(task)
    if split not in spec.splits:
        raise ValueError(f"split must be one of {sorted(spec.splits)}, got {split!r}")
    directory = dataset_dir(data_dir, task, config)
    builder = tfds.builder_from_directory(directory)
    name = spec.splits[split]
    present = sorted(builder.info.splits.keys())
    if name.split("[", 1)[0] not in present:
        # A generated config prepared with --num_validation=0 (or --num_test=0) has no
        # such split: TFDS cannot write an empty one.
        raise ValueError(
            f"the prepared LRA {task!r} dataset in {directory} has no {name!r} split (it has "
            f"{present}); training reads train, validation and test: prepare a config with "
            f"all three (--num_{split}=N >= 1)"
        )
    return builder.as_data_source(split=name)


class SequenceTooLong(ValueError):
    """A sequence is longer than the padded length and truncation was not asked for."""


def pad_tokens(
    tokens: np.ndarray, max_length: int, truncate: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads (or, with ``truncate``, cuts) a token sequence.

    Args:
      tokens: [n] integer ids.
      max_length: L.
      truncate: cut sequences longer than L to their first L tokens; False: such a
        sequence raises ``SequenceTooLong``.

    Returns:
      (ids int32 [L], mask bool [L]); padding is id 0 with mask False.
    """
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.shape[0] > max_length:
        if not truncate:
            raise SequenceTooLong(
                f"a sequence of {tokens.shape[0]} tokens is longer than max_length="
                f"{max_length} (set task.truncate=True to cut such sequences)"
            )
        tokens = tokens[:max_length]
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
    truncate: bool = False

    def map(self, element: dict[str, Any]) -> Batch:
        out: Batch = {
            "targets": np.asarray(element["targets"], dtype=np.int32),
            "example_mask": np.asarray(True),
        }
        if self.dual_input:
            for i in (0, 1):
                out[f"inputs{i}"], out[f"mask{i}"] = pad_tokens(
                    element[f"inputs{i}"], self.max_length, self.truncate
                )
        else:
            out["inputs"], out["mask"] = pad_tokens(
                element["inputs"], self.max_length, self.truncate
            )
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


@dataclasses.dataclass(frozen=True)
class LengthReport:
    """Sequences of a split longer than a padded length.

    Attributes:
      examples: examples in the split.
      too_long: examples with a sequence (either document for Retrieval) longer than
        ``max_length``.
      longest: the longest sequence's length.
      max_length: the padded length compared against.
    """

    examples: int
    too_long: int
    longest: int
    max_length: int


def length_report(source: Any, *, task: str, max_length: int) -> LengthReport:
    """Scans ``source`` (every example once) for sequences longer than ``max_length``.

    Fixed-length tasks (the pixel tasks) are not scanned: every example has the task's
    length.
    """
    spec = tasks.get_task(task)
    count = len(source)
    if spec.fixed_length:
        over = count if spec.max_length > max_length else 0
        return LengthReport(count, over, spec.max_length if count else 0, max_length)
    keys = ("inputs0", "inputs1") if spec.dual_input else ("inputs",)
    too_long, longest = 0, 0
    getitems = getattr(source, "__getitems__", None)
    chunk = 1024
    for start in range(0, count, chunk):
        indices = list(range(start, min(start + chunk, count)))
        items = getitems(indices) if getitems is not None else [source[i] for i in indices]
        for item in items:
            n = max(int(np.asarray(item[k]).reshape(-1).shape[0]) for k in keys)
            longest = max(longest, n)
            too_long += n > max_length
    return LengthReport(count, too_long, longest, max_length)


def train_examples(
    source: Any, *, task: str, max_length: int, seed: int, truncate: bool = False
) -> grain.MapDataset:
    """Endless shuffled, padded training examples (random access; unbatched).

    Example ``s * B + r`` is row ``r`` of the batch of step ``s`` for batch size ``B``
    (``batch_examples``); epoch ``e`` is the source shuffled by (seed, e).
    """
    spec = tasks.get_task(task)
    if len(source) < 1:
        raise ValueError("the training split is empty")
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    return ds.map(PadAndMask(max_length=max_length, dual_input=spec.dual_input, truncate=truncate))


def batch_examples(examples: grain.MapDataset, batch_size: int) -> grain.MapDataset:
    """``train_examples`` as batches of ``batch_size`` (random access; index = step)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return examples.batch(batch_size, drop_remainder=True)


def make_dataset(
    source: Any,
    *,
    task: str,
    batch_size: int,
    max_length: int | None = None,
    truncate: bool = False,
    shard_index: int = 0,
    shard_count: int = 1,
    worker_count: int = 0,
) -> grain.IterDataset:
    """The evaluation pipeline over a random-access `source`: file order, one pass,
    batched, the last batch filled up with all-padding rows (``example_mask`` False).

    Args:
      source: e.g. `open_split(...)` (anything with __len__ and __getitem__ that
        returns stored examples).
      task: a key of `lra.tasks.TASKS`.
      batch_size: rows per host batch B.
      max_length: L; default the task's reference length.
      truncate: cut longer sequences to L (else they raise ``SequenceTooLong``).
      shard_index, shard_count: this host's share of the examples (strided); every
        share has the same number of batches (the short ones end in padding rows).
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
    pad = PadAndMask(max_length=length, dual_input=spec.dual_input, truncate=truncate)
    ds = grain.MapDataset.source(source)
    if shard_count > 1:
        ds = _equal_shard(ds, pad, shard_index, shard_count)
    else:
        ds = ds.map(pad)
    ds = ds.batch(batch_size, drop_remainder=False).map(FillBatch(batch_size))
    it_ds = ds.to_iter_dataset()
    if worker_count > 0:
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return it_ds


def _equal_shard(
    ds: grain.MapDataset, pad: PadAndMask, shard_index: int, shard_count: int
) -> grain.MapDataset:
    """Examples ``shard_index::shard_count`` of ``ds``, padded, then filled up with
    all-padding examples (every field 0: ``example_mask`` False) to ``ceil(N /
    shard_count)``, so that every host gets the same number of batches: hosts that
    evaluate in step (a collective per batch) would otherwise wait for one another's
    extra batch forever."""
    total = len(ds)
    per_shard = -(-total // shard_count)
    filler = None
    if total:
        filler = {k: np.zeros_like(v) for k, v in pad.map(ds[0]).items()}

    def example(position: int, _: Any) -> Batch:
        index = shard_index + position * shard_count
        return pad.map(ds[index]) if index < total else dict(filler)

    return grain.MapDataset.range(per_shard).map_with_index(example)


def create_dataset(
    data_dir: str | os.PathLike,
    task: str,
    split: str,
    *,
    batch_size: int,
    config: str | None = None,
    **kwargs: Any,
) -> grain.IterDataset:
    """`make_dataset(open_split(data_dir, task, split, config), ...)`: evaluation order."""
    source = open_split(data_dir, task, split, config)
    return make_dataset(source, task=task, batch_size=batch_size, **kwargs)
