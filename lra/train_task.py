"""The five LRA tasks as training tasks (``lra_listops``, ``lra_text``, ``lra_retrieval``,
``lra_image``, ``lra_pathfinder``), registered with ``sbm_jax.tasks.register_task``.

Importing this module registers them (``scripts/train.py`` does). Config fields read,
all under ``config.task`` (documented in ``configs/lra/common.py``): ``source``
("tfds" | "generated" | "mock"), ``data_dir``, ``data_config``, ``max_length``,
``truncate``, ``eval_batch_size``, ``max_eval_batches``, ``generate``, ``mock_examples``.
``check_config`` checks them (and the model fields they bind) without reading data; the
registry runs it before anything is generated.

Sequences longer than ``task.max_length`` are an error naming the dataset, the split,
how many there are and the longest length, unless ``task.truncate`` is True, in which
case they are cut and the run says how many.

Batches are the grain pipeline's (``lra.input_pipeline``) plus ``weights`` float32
[batch] (= ``example_mask``, so filler rows of the last eval batch count for nothing).
The training order is a pure function of (seed, step): the pipeline is a random-access
grain ``MapDataset`` (shuffle per epoch, repeat, batch) sliced at the start step, so a
resumed run sees exactly the batches an uninterrupted run would.

Multi-process jobs: row ``r`` of the batch of step ``s`` is example ``s * B + r`` of the
shuffled, repeated, unbatched dataset, so each process reads just the rows the trainer
asks for (``process_train_batches``) by random access. This, rather than grain's
``ShardOptions`` (a strided shard of the examples per process, each shuffled on its
own), keeps the global batch of every step the same for any number of processes: losses
match a one-process run and a run can resume on a different number of hosts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import grain
import jax
import numpy as np

from lra import builders, input_pipeline
from lra import tasks as lra_tasks
from sbm_jax.tasks import register_task
from sbm_jax.training.task import (
    Batch,
    Task,
    classification_loss,
    default_model_inputs,
    dual_encoder_model_inputs,
    may_prepare_data,
)

SOURCES = ("tfds", "generated", "mock")


def default_data_dir() -> str:
    """``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets`` (TFDS's own default)."""
    return os.path.expanduser(os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets")


def data_dir_of(cfg: Any) -> str:
    """``task.data_dir`` with ``~`` expanded, or :func:`default_data_dir`."""
    return os.path.expanduser(cfg.get("data_dir") or default_data_dir())


class MockSource:
    """Random examples shaped like a stored LRA split, with a learnable label.

    The label is the first token modulo the number of classes, so a model can fit it
    (smoke runs show the loss fall); lengths vary between ``max_length // 2`` and
    ``max_length``. Example ``i`` of split ``split`` is drawn from
    ``default_rng([seed, split_id, i])``.
    """

    def __init__(self, task: str, split: str, num_examples: int, max_length: int, seed: int):
        self.spec = lra_tasks.get_task(task)
        self.split_id = ("train", "validation", "test").index(split)
        self.num_examples = num_examples
        self.max_length = max_length
        self.seed = seed

    def __len__(self) -> int:
        return self.num_examples

    def _tokens(self, rng: np.random.Generator) -> np.ndarray:
        low = 0 if self.spec.name in ("image", "pathfinder") else 1  # pixels are never padding
        if self.spec.name in ("image", "pathfinder"):
            length = self.max_length
        else:
            length = int(rng.integers(max(self.max_length // 2, 1), self.max_length + 1))
        return rng.integers(low, self.spec.vocab_size, size=(length,), dtype=np.int32)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_examples:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, self.split_id, index])
        if self.spec.dual_input:
            a, b = self._tokens(rng), self._tokens(rng)
            target = int(a[0] + b[0]) % self.spec.num_classes
            return {"inputs0": a, "inputs1": b, "targets": np.int32(target)}
        tokens = self._tokens(rng)
        return {"inputs": tokens, "targets": np.int32(int(tokens[0]) % self.spec.num_classes)}


def generated_config(task: str, cfg: Any) -> Any:
    """The builder config of ``task.generate`` (checked, nothing generated)."""
    options = cfg.get("generate") or {}
    options = options.to_dict() if hasattr(options, "to_dict") else dict(options)
    try:
        return builders.make_config(task, source="generated", **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"task.generate={options} is not valid for {task!r}: {e}") from None


def prepare_generated(task: str, config: Any, data_dir: str) -> None:
    """Generate and write the dataset of builder ``config`` under ``data_dir``.

    Every process of a job does this when the dataset is missing (on hosts with their
    own disks each needs its copy). On a shared ``data_dir`` they race: TFDS writes
    into a private temporary folder and renames it at the end, and the renames after
    the first fail because the folder exists. The dataset is then complete (the rename
    is atomic), so a process whose write failed uses it if it is there.
    """
    try:
        builders.make_builder(task, config, data_dir=data_dir).download_and_prepare(
            file_format="array_record"
        )
    except Exception as error:
        try:
            input_pipeline.dataset_dir(data_dir, task, config.name)
        except FileNotFoundError:
            raise error from None  # the write failed and nobody else made it
        print(f"{task} dataset {config.name!r} was written by another process; using it")


def _named_prepared(task: str, cfg: Any) -> str | None:
    """With source="generated": the prepared dataset ``task.data_config`` names instead
    of the one ``task.generate`` describes (None when it names none, or that one).

    Raises:
      ValueError: naming ``task.data_config`` when no such dataset is prepared.
    """
    named = str(cfg.get("data_config") or "")
    if not named or named == generated_config(task, cfg).name:
        return None
    try:
        input_pipeline.dataset_dir(data_dir_of(cfg), task, named)
    except FileNotFoundError as e:
        raise ValueError(
            f"task.data_config={named!r}: {e} (or leave task.data_config empty to generate "
            "the dataset task.generate describes)"
        ) from None
    return named


def _data_config(task: str, cfg: Any, announce: bool = False) -> str | None:
    """The builder config name to read; for source="generated" the dataset
    ``task.data_config`` names when it is prepared (``lra.prepare``'s), else the one
    ``task.generate`` describes, prepared under data_dir first if missing. With
    ``announce``, says which (and which other prepared datasets it leaves aside)."""
    data_dir = data_dir_of(cfg)
    if cfg.source == "generated":
        if task not in ("listops", "pathfinder"):
            raise ValueError(
                f"task.source='generated' only applies to listops and pathfinder, not {task!r}"
            )
        named = _named_prepared(task, cfg)
        if named is not None:
            if announce and jax.process_index() == 0:
                print(
                    f"task.data_config={named!r}: training on that prepared {task} dataset in "
                    f"{data_dir} (task.generate describes another and is not used)",
                    flush=True,
                )
            return named
        config = generated_config(task, cfg)
        try:
            input_pipeline.dataset_dir(data_dir, task, config.name)
        except FileNotFoundError:
            if not may_prepare_data.get():
                raise
            others = input_pipeline.prepared_configs(data_dir, task)
            if announce and others and jax.process_index() == 0:
                print(
                    f"note: generating {task} dataset {config.name!r} in {data_dir} from "
                    f"task.generate; prepared there already: {', '.join(others)} (to train on "
                    "one, set task.data_config to its name)",
                    flush=True,
                )
            prepare_generated(task, config, data_dir)
        return config.name
    return cfg.get("data_config") or None


def open_sources(task: str, config: Any) -> dict[str, Any]:
    """{"train", "validation", "test"} random-access sources for ``config.task``."""
    cfg = config.task
    if cfg.source not in SOURCES:
        raise ValueError(f"task.source={cfg.source!r} must be one of {SOURCES}")
    if cfg.source == "mock":
        n = int(cfg.get("mock_examples", 64))
        if n < 1:
            raise ValueError(f"task.mock_examples={n} must be >= 1")
        return {
            split: MockSource(task, split, n, int(cfg.max_length), int(config.seed))
            for split in ("train", "validation", "test")
        }
    data_dir = data_dir_of(cfg)
    data_config = _data_config(task, cfg, announce=True)
    return {
        split: input_pipeline.open_split(data_dir, task, split, data_config)
        for split in ("train", "validation", "test")
    }


def _add_weights(batch: Batch) -> Batch:
    out = dict(batch)
    out["weights"] = np.asarray(batch["example_mask"], np.float32)
    return out


def train_rows(examples: grain.MapDataset, batch_size: int, step: int, rows: Any) -> Batch:
    """Rows ``rows`` (int [n], indices into the global batch) of step ``step``'s batch.

    Equal to ``batch_examples(examples, batch_size)[step]`` (with weights) restricted to
    those rows: row ``r`` is example ``step * batch_size + r`` of ``examples``
    (``input_pipeline.train_examples``).
    """
    rows = np.asarray(rows, np.int64)
    if rows.ndim != 1 or rows.size == 0 or rows.min() < 0 or rows.max() >= batch_size:
        raise ValueError(f"rows must be indices in [0, train.batch_size={batch_size}), got {rows}")
    items = [examples[step * batch_size + int(r)] for r in rows]
    return _add_weights({k: np.stack([item[k] for item in items]) for k in items[0]})


def eval_batches(
    source: Any,
    task: str,
    batch_size: int,
    max_length: int,
    max_batches: int = 0,
    truncate: bool = False,
) -> Iterable[Batch]:
    """File-order evaluation batches, the last one filled up with zero-weight rows."""
    ds = input_pipeline.make_dataset(
        source, task=task, batch_size=batch_size, max_length=max_length, truncate=truncate
    )
    for i, batch in enumerate(ds):
        if max_batches and i >= max_batches:
            return
        yield _add_weights(batch)


def check_config(task: str, config: Any) -> None:
    """Task-specific checks of the config alone (no data is read); messages name the
    field."""
    spec = lra_tasks.get_task(task)
    cfg, model = config.task, config.model
    length = cfg.get("max_length")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"task.max_length={length!r} must be a positive integer")
    if model.get("max_len", 0) < length:
        raise ValueError(f"model.max_len={model.get('max_len')} is below task.max_length={length}")
    if model.get("vocab_size", 0) < spec.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.get('vocab_size')} is below the {task} vocabulary "
            f"size {spec.vocab_size}"
        )
    if model.get("num_classes") != spec.num_classes:
        raise ValueError(
            f"model.num_classes={model.get('num_classes')} must be {spec.num_classes} for {task}"
        )
    for name in ("eval_batch_size", "max_eval_batches"):
        value = cfg.get(name, 0)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"task.{name}={value!r} must be a non-negative integer")
    if not isinstance(cfg.get("truncate", False), bool):
        raise ValueError(f"task.truncate={cfg.get('truncate')!r} must be True or False")
    if cfg.get("source") not in SOURCES:
        raise ValueError(f"task.source={cfg.get('source')!r} must be one of {SOURCES}")
    if cfg.source == "mock":
        n = cfg.get("mock_examples", 64)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"task.mock_examples={n!r} must be >= 1")
        if cfg.get("data_config"):
            raise ValueError(
                f"task.data_config={cfg.get('data_config')!r} does not apply to "
                "task.source='mock' (random examples, no dataset read); clear it or set "
                "task.source"
            )
    if cfg.source == "generated":
        if task not in ("listops", "pathfinder"):
            raise ValueError(
                f"task.source='generated' only applies to listops and pathfinder, not {task!r}"
            )
        generated = generated_config(task, cfg)
        _named_prepared(task, cfg)  # a named dataset must exist: refused before any work
        for split in ("train", "validation", "test"):
            size = getattr(generated, f"num_{split}")
            if size < 1:
                raise ValueError(
                    f"task.generate.num_{split}={size} must be >= 1: training reads the "
                    "train, validation and test splits"
                )


def check_lengths(source: Any, task: str, split: str, config: Any, where: str) -> None:
    """Refuse (or, with ``task.truncate``, report) sequences longer than
    ``task.max_length`` in one split."""
    length = int(config.task.max_length)
    report = input_pipeline.length_report(source, task=task, max_length=length)
    if not report.too_long:
        return
    what = (
        f"{report.too_long} of {report.examples} {split} examples of {where} are longer than "
        f"task.max_length={length} (the longest has {report.longest} tokens)"
    )
    if not config.task.get("truncate", False):
        raise ValueError(f"{what}; set task.truncate=True to cut them, or raise task.max_length")
    if jax.process_index() == 0:
        print(f"task.truncate=True: cutting these to {length} tokens: {what}", flush=True)


def _where(task: str, config: Any) -> str:
    cfg = config.task
    if cfg.source == "mock":
        return "the mock data"
    data_dir = data_dir_of(cfg)
    try:
        return input_pipeline.dataset_dir(data_dir, task, _data_config(task, cfg))
    except FileNotFoundError:
        return data_dir


def build_lra_task(task: str, config: Any) -> Task:
    """The ``Task`` of LRA ``task`` from ``config`` (see the module docstring)."""
    check_config(task, config)
    spec = lra_tasks.get_task(task)
    sources = open_sources(task, config)
    where = _where(task, config)
    for split, source in sources.items():
        check_lengths(source, task, split, config, where)
    length = int(config.task.max_length)
    truncate = bool(config.task.get("truncate", False))
    batch_size = int(config.train.batch_size)
    if len(sources["train"]) < batch_size:
        raise ValueError(
            f"the training split has {len(sources['train'])} examples, fewer than "
            f"train.batch_size={batch_size}"
        )
    eval_size = int(config.task.get("eval_batch_size", 0)) or batch_size
    max_eval = int(config.task.get("max_eval_batches", 0))
    examples = input_pipeline.train_examples(
        sources["train"], task=task, max_length=length, seed=int(config.seed), truncate=truncate
    )
    train_ds = input_pipeline.batch_examples(examples, batch_size).map(_add_weights)

    def train_batches(start_step: int) -> Iterator[Batch]:
        step = start_step
        while True:
            yield train_ds[step]
            step += 1

    def process_train_batches(start_step: int, rows: np.ndarray) -> Iterator[Batch]:
        step = start_step
        while True:
            yield train_rows(examples, batch_size, step, rows)
            step += 1

    def split_batches(split: str):
        cap = max_eval if split == "validation" else 0  # the test split is always whole

        def batches() -> Iterable[Batch]:
            return eval_batches(sources[split], task, eval_size, length, cap, truncate)

        return batches

    return Task(
        name=f"lra_{task}",
        head="dual_encoder" if spec.dual_input else "classification",
        train_batches=train_batches,
        eval_batches=split_batches("validation"),
        test_splits={"test": split_batches("test")},
        process_train_batches=process_train_batches,
        loss_fn=classification_loss,
        model_inputs=dual_encoder_model_inputs if spec.dual_input else default_model_inputs,
    )


def _register(task: str) -> None:
    def check(config: Any) -> None:
        check_config(task, config)

    @register_task(f"lra_{task}", check=check)
    def build(config: Any) -> Task:
        return build_lra_task(task, config)

    build.__doc__ = f"LRA {task} (see lra.train_task.build_lra_task)."


for _name in lra_tasks.TASKS:
    _register(_name)
