"""GLUE as tasks of the one trainer: MLM pretraining (``glue_mlm``) and fine-tuning
(``glue_sst2``, ``glue_qqp``, ``glue_mnli``, ``glue_qnli``), registered with
``sbm_jax.tasks.register_task``; ``scripts/train.py`` imports this module.

``glue_mlm``: documents (``data.corpus`` glob or a TFDS text builder) -> byte-level BPE
tokenizer (trained unless ``data.tokenizer``; a resumed run reuses the one it saved) ->
packed, masked sequences (``glue.mlm``). ``model.vocab_size`` becomes the tokenizer's
size and ``train.num_steps`` follows ``train.num_epochs``: both are recorded in
summary.json's config. The run directory gets ``tokenizer.json`` and
``mlm_data_fingerprint.json`` (a resumed run whose corpus packs differently is refused).

``glue_<task>``: ``config.init_from`` names the pretraining run (or one of its
checkpoints); the encoder fields of ``model`` are taken from that checkpoint's config,
its tokenizer from beside it (``data.tokenizer`` may name a copy of that one, no other),
and the trainer puts the pretrained encoder into the fresh classifier
(``glue.models.transplant_encoder``). The dev split (MNLI: matched) is evaluated during
training with accuracy, F1 and macro-F1 and picks the best checkpoint
(``checkpoint.best_metric``); every validation split is scored at the best checkpoint,
and the unlabelled test split(s) are predicted there, in full, and written in the GLUE
submission format (``predictions/SST-2.tsv``, ``MNLI-m.tsv`` ...).
summary.json carries the Table 4 ``headline`` (F1, MNLI macro-F1, averaged over the
validation splits) and its accuracy for ``scripts/glue_report.py``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import ml_collections
import numpy as np

from glue import corpus as corpus_lib
from glue.data import EncodedSplit, EpochStream, get_task_spec, load_glue_split, steps_for_epochs
from glue.metrics import metrics_from_confusion
from glue.mlm import (
    build_mlm_task_from_data,
    check_data_fingerprint,
    load_documents,
    pack_corpus,
    prepare_tokenizer,
    save_data_fingerprint,
)
from glue.models import transplant_encoder
from glue.tokenizer import (
    TOKENIZER_FILE,
    check_pretraining_tokenizer,
    load_tokenizer,
    save_tokenizer,
    special_ids,
)
from sbm_jax.models.build import ENCODER_DEFAULTS
from sbm_jax.tasks import register_task
from sbm_jax.training.checkpoints import (
    find_checkpoint,
    read_checkpoint_meta,
    run_dir_of_checkpoint,
)
from sbm_jax.training.config_checks import ConfigError
from sbm_jax.training.task import Batch, Task, classification_loss

GLUE_TASK_NAMES = ("sst2", "qqp", "mnli", "qnli")

# ``model`` fields that define the encoder and so must come from the checkpoint.
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "max_len",
    "emb_dim",
    "num_layers",
    "num_heads",
    "head_dim",
    "mlp_dim",
    "attention",
    "attention_options",
    "position_embedding",
    "final_norm",
)
# What a field absent from an older checkpoint's config meant (the encoder's default).
ARCHITECTURE_DEFAULTS = {
    name: ENCODER_DEFAULTS[name] for name in ("position_embedding", "final_norm")
}


def derive_schedule(config: Any, num_examples: int) -> None:
    """Set ``train.num_steps`` from ``train.num_epochs`` (when > 0) and
    ``train.warmup_steps`` from ``train.warmup_fraction``."""
    train_cfg = config.train
    epochs = float(train_cfg.num_epochs)
    if epochs > 0:
        train_cfg.num_steps = steps_for_epochs(num_examples, int(train_cfg.batch_size), epochs)
    train_cfg.warmup_steps = int(float(train_cfg.warmup_fraction) * int(train_cfg.num_steps))


def _check_rate(errors: list[str], section: Any, prefix: str, name: str, high: float = 1.0) -> None:
    value = section.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= high:
        errors.append(f"{prefix}.{name}={value!r} must lie in [0, {high:g}]")


def _raise(errors: list[str]) -> None:
    if errors:
        raise ValueError("; ".join(errors))


# --- MLM pretraining ---------------------------------------------------------------


def check_mlm_config(config: Any) -> None:
    """Config checks of ``glue_mlm`` (no data read); messages name the field."""
    data, errors = config.data, []
    if data.get("corpus"):
        try:
            corpus_lib.corpus_files(str(data.corpus), flag="data.corpus")
        except (ValueError, FileNotFoundError) as e:
            errors.append(str(e))
    elif not data.get("tfds_name"):
        errors.append(
            "data.corpus='' and data.tfds_name='': give a corpus, e.g. "
            "--config.data.corpus='text/*.txt'"
        )
    if data.get("tokenizer") and not os.path.exists(os.path.expanduser(str(data.tokenizer))):
        errors.append(f"data.tokenizer={data.tokenizer!r}: no such file")
    for name in ("mask_rate", "mask_token_rate", "random_token_rate", "eval_fraction"):
        _check_rate(errors, data, "data", name)
    if isinstance(data.get("mask_token_rate"), float) and isinstance(
        data.get("random_token_rate"), float
    ):
        if data.mask_token_rate + data.random_token_rate > 1.0:
            errors.append(
                f"data.mask_token_rate={data.mask_token_rate} + data.random_token_rate="
                f"{data.random_token_rate} exceeds 1"
            )
    max_len = data.get("max_len")
    if not isinstance(max_len, int) or max_len < 2:
        errors.append(f"data.max_len={max_len!r} must be an integer >= 2")
    elif isinstance(config.model.get("max_len"), int) and max_len > config.model.max_len:
        errors.append(f"data.max_len={max_len} exceeds model.max_len={config.model.max_len}")
    for name in ("max_predictions", "eval_sequences_max", "tokenizer_min_frequency"):
        value = data.get(name)
        if not isinstance(value, int) or value < 1:
            errors.append(f"data.{name}={value!r} must be a positive integer")
    if config.model.get("pooling") != "none":
        errors.append(f"model.pooling={config.model.get('pooling')!r} must be 'none' for MLM")
    _raise(errors)


def build_mlm_task(config: Any, output_dir: str | None = None) -> Task:
    """The ``glue_mlm`` task (see the module docstring)."""
    check_mlm_config(config)
    documents = load_documents(config)
    tokenizer = prepare_tokenizer(config, documents, output_dir)
    config.model.vocab_size = tokenizer.get_vocab_size()  # a small corpus may give fewer
    data = pack_corpus(config, tokenizer, documents)
    check_data_fingerprint(config, data, output_dir)  # a resumed run: the same corpus?
    derive_schedule(config, len(data.train))
    task = build_mlm_task_from_data(config, data)
    extra = {
        "vocab_size": data.vocab_size,
        "train_sequences": len(data.train),
        "eval_sequences": len(data.eval),
        "corpus_tokens": data.num_tokens,
    }

    def save_files(directory: str) -> None:
        save_tokenizer(tokenizer, directory)
        save_data_fingerprint(data, directory)

    def summarize(summary: Mapping[str, Any]) -> dict[str, Any]:
        return {
            **extra,
            "tokenizer": os.path.join(str(summary["output_dir"]), TOKENIZER_FILE),
            "mlm_loss": summary.get("loss"),
            "mlm_accuracy": summary.get("accuracy"),
            "first_mlm_loss": summary.get("first_loss"),
        }

    return Task(
        name=task.name,
        head=task.head,
        train_batches=task.train_batches,
        eval_batches=task.eval_batches,
        loss_fn=task.loss_fn,
        model_inputs=task.model_inputs,
        make_model=task.make_model,
        summarize=summarize,
        save_files=save_files,
    )


# --- fine-tuning --------------------------------------------------------------------


def check_finetune_config(name: str, config: Any, with_checkpoint: bool = True) -> None:
    """Config checks of ``glue_<name>`` (no data read); messages name the field.
    ``with_checkpoint``: also read ``init_from``'s metadata for its mechanism (the task's
    builder leaves that to :func:`apply_checkpoint_architecture`, which reads it anyway)."""
    spec = get_task_spec(name)
    data, errors = config.data, []
    if int(config.model.get("num_classes", 0)) != spec.num_classes:
        errors.append(
            f"model.num_classes={config.model.get('num_classes')} but {spec.name} has "
            f"{spec.num_classes} classes"
        )
    if not config.get("init_from") and not data.get("tokenizer"):
        errors.append(
            "init_from='' (a pretraining run to fine-tune) and data.tokenizer='': give "
            "--config.init_from=runs/<pretraining run>"
        )
    if data.get("tokenizer") and not os.path.exists(os.path.expanduser(str(data.tokenizer))):
        errors.append(f"data.tokenizer={data.tokenizer!r}: no such file")
    for field in ("max_train_examples", "max_eval_examples"):
        value = data.get(field, 0)
        if not isinstance(value, int) or value < 0:
            errors.append(f"data.{field}={value!r} must be a non-negative integer")
    if not isinstance(data.get("truncate", True), bool):
        errors.append(f"data.truncate={data.get('truncate')!r} must be True or False")
    max_len = data.get("max_len")
    if not isinstance(max_len, int) or max_len < 4:
        errors.append(f"data.max_len={max_len!r} must be an integer >= 4")
    eval_batch = config.train.get("eval_batch_size", 1)
    if not isinstance(eval_batch, int) or eval_batch < 1:
        errors.append(f"train.eval_batch_size={eval_batch!r} must be a positive integer")
    _raise(errors)
    if with_checkpoint and config.get("init_from"):
        # The checkpoint's mechanism, read from its metadata alone (no data, no state), so
        # that --dry_run catches the wrong preset before a job starts, not after.
        try:
            meta = read_checkpoint_meta(find_checkpoint(str(config.init_from)))
        except Exception:  # noqa: BLE001 (building the task reads it again and says why)
            return
        check_checkpoint_mechanism(config, (meta.get("config") or {}).get("model"))


def check_checkpoint_mechanism(config: Any, saved: Mapping[str, Any] | None) -> None:
    """A ``config.model.attention`` other than the pretraining checkpoint's is an error
    naming both (the fine-tuning preset names the wrong mechanism)."""
    if not isinstance(saved, Mapping):
        raise ConfigError(
            "config.init_from: the checkpoint's metadata holds no model config (not a "
            "checkpoint of this trainer?)"
        )
    if str(saved.get("attention")) != str(config.model.attention):
        raise ConfigError(
            f"config.model.attention={config.model.attention!r} but the checkpoint was "
            f"pretrained with {saved.get('attention')!r}; pick the matching mechanism preset"
        )
    # sbm and sbm_nowindow are one mechanism: the window tells them apart (and labels
    # the run's row in Table 4), so it must be the checkpoint's too.
    mine = (config.model.get("attention_options") or {}).get("window", 0)
    theirs = (saved.get("attention_options") or {}).get("window", 0)
    if int(mine or 0) != int(theirs or 0):
        preset = config.get("mechanism", config.model.attention)
        raise ConfigError(
            f"config.model.attention_options.window={mine} (preset {preset!r}) but the "
            f"checkpoint was pretrained with window {theirs}; pick the matching preset "
            "(sbm: with the window, sbm_nowindow: without)"
        )


def apply_checkpoint_architecture(config: Any, saved: Mapping[str, Any] | None) -> None:
    """Copy the encoder fields of the checkpoint's model config into ``config.model``.

    A different ``model.attention`` is an error (the preset names the wrong mechanism).
    """
    check_checkpoint_mechanism(config, saved)
    with config.unlocked():
        for name in ARCHITECTURE_FIELDS:
            if name not in saved and name not in ARCHITECTURE_DEFAULTS:
                raise ConfigError(f"config.init_from: the checkpoint's model config lacks {name!r}")
            value = saved.get(name, ARCHITECTURE_DEFAULTS.get(name))
            if name == "attention_options":
                value = ml_collections.ConfigDict(
                    {k: tuple(v) if isinstance(v, list) else v for k, v in (value or {}).items()}
                )
            config.model[name] = value
    if int(config.data.max_len) > int(config.model.max_len):
        raise ConfigError(
            f"config.data.max_len={config.data.max_len} exceeds the checkpoint's "
            f"model.max_len={config.model.max_len}"
        )


def write_submission(
    name: str, split: str, index: np.ndarray, predictions: np.ndarray, output_dir: str
) -> str:
    """``<output_dir>/predictions/<file>.tsv`` in the GLUE submission format (header
    ``index\\tprediction``; MNLI and QNLI as label names, the others as 0/1)."""
    spec = get_task_spec(name)
    files = dict(spec.test_files)
    directory = os.path.join(output_dir, "predictions")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{files[split]}.tsv")
    order = np.argsort(index, kind="stable")
    with open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for i in order:
            label = int(predictions[i])
            shown = spec.label_names[label] if spec.label_names else str(label)
            f.write(f"{int(index[i])}\t{shown}\n")
    return path


def build_finetune_task(name: str, config: Any, output_dir: str | None = None) -> Task:
    """The ``glue_<name>`` task (see the module docstring)."""
    check_finetune_config(name, config, with_checkpoint=False)  # the meta is read below
    spec = get_task_spec(name)
    tokenizer_path = str(config.data.tokenizer or "")
    run_tokenizer = ""  # the pretraining run's tokenizer.json, when fine-tuning from one
    if config.get("init_from"):
        checkpoint = find_checkpoint(str(config.init_from))
        meta = read_checkpoint_meta(checkpoint)
        apply_checkpoint_architecture(config, (meta.get("config") or {}).get("model"))
        source_task = ((meta.get("config") or {}).get("task") or {}).get("name")
        if source_task and source_task != "glue_mlm":
            print(
                f"note: config.init_from is a {source_task} run, not a pretraining run: its "
                "encoder is used and its head dropped",
                flush=True,
            )
        run_tokenizer = os.path.join(run_dir_of_checkpoint(checkpoint), TOKENIZER_FILE)
        if not tokenizer_path:
            tokenizer_path = run_tokenizer
    field = (
        "config.data.tokenizer"
        if config.data.tokenizer
        else "config.data.tokenizer='' and the tokenizer beside config.init_from's run"
    )
    tokenizer = load_tokenizer(tokenizer_path, flag=field)
    if not config.get("init_from"):
        print(
            "warning: config.init_from is empty: the encoder starts from random weights, not "
            "a pretrained one (scripts/glue_report.py leaves such runs out of Table 4)",
            flush=True,
        )
    if config.data.tokenizer and run_tokenizer:
        check_pretraining_tokenizer(tokenizer, tokenizer_path, run_tokenizer)
    if tokenizer.get_vocab_size() > int(config.model.vocab_size):
        raise ConfigError(
            f"the tokenizer {tokenizer_path!r} has {tokenizer.get_vocab_size()} tokens but "
            f"config.model.vocab_size is {config.model.vocab_size}"
        )
    special = special_ids(tokenizer)
    data_dir = str(config.data.tfds_data_dir) or None
    max_len = int(config.data.max_len)
    download = bool(config.data.tfds_download)
    truncate = bool(config.data.get("truncate", True))

    def load(split: str, limit: int) -> EncodedSplit:
        encoded = load_glue_split(
            spec, split, tokenizer, max_len, special, data_dir, limit, download, truncate
        )
        if encoded.truncated:
            print(
                f"data.truncate=True: cut {encoded.truncated} of {len(encoded)} examples of "
                f"{spec.tfds_name} split {split!r} to data.max_len={max_len} (the longest "
                f"had {encoded.longest} tokens)",
                flush=True,
            )
        return encoded

    train_split = load("train", int(config.data.max_train_examples))
    eval_splits = {s: load(s, int(config.data.max_eval_examples)) for s in spec.eval_splits}
    # The unlabelled test splits are read in full whatever data.max_eval_examples says:
    # a GLUE submission file must hold a prediction for every test example.
    test_splits = {s: load(s, 0) for s, _ in spec.test_files}
    derive_schedule(config, len(train_split))
    batch_size = int(config.train.batch_size)
    eval_size = int(config.train.get("eval_batch_size", batch_size))
    stream = EpochStream(len(train_split), batch_size, int(config.seed))

    def train_batches(start_step: int) -> Iterator[Batch]:
        for idx in stream.iterate(start_step):
            yield train_split.batch(idx, max_len, special.pad)

    def process_train_batches(start_step: int, rows: np.ndarray) -> Iterator[Batch]:
        # One process of a multi-process job tokenises and pads only its rows.
        for idx in stream.iterate(start_step):
            yield train_split.batch(idx[rows], max_len, special.pad)

    def split_batches(encoded: EncodedSplit):
        def batches() -> list[Batch]:
            return encoded.padded_batches(eval_size, max_len, special.pad)

        return batches

    def init_params(fresh: Any, loaded: Any) -> Any:
        try:
            return transplant_encoder(fresh, loaded)
        except ValueError as e:
            raise ConfigError(f"config.init_from: {e}") from None

    def write_predictions(split: str, index: np.ndarray, predicted: np.ndarray, out: str) -> str:
        return write_submission(name, split, index, predicted, out)

    def summarize(summary: Mapping[str, Any]) -> dict[str, Any]:
        splits = summary.get("test_splits") or {}
        scores = [m[spec.metric] for m in splits.values() if spec.metric in m]
        accuracy = [m["accuracy"] for m in splits.values() if "accuracy" in m]
        return {
            "glue_task": spec.name,
            "mechanism": str(config.get("mechanism", config.model.attention)),
            "metric": spec.metric,
            "headline": float(np.mean(scores)) if scores else None,
            "headline_accuracy": float(np.mean(accuracy)) if accuracy else None,
            "train_examples": len(train_split),
            "tokenizer": tokenizer_path,
        }

    def save_files(directory: str) -> None:
        target = os.path.join(directory, TOKENIZER_FILE)
        if os.path.abspath(tokenizer_path) != os.path.abspath(target):
            shutil.copyfile(tokenizer_path, target)

    return Task(
        name=f"glue_{name}",
        head="classification",
        train_batches=train_batches,
        process_train_batches=process_train_batches,
        eval_batches=split_batches(eval_splits[spec.eval_splits[0]]),
        loss_fn=classification_loss,
        test_splits={s: split_batches(e) for s, e in eval_splits.items()},
        init_params=init_params,
        confusion_classes=spec.num_classes,
        eval_metrics=metrics_from_confusion,
        predict_splits={s: split_batches(e) for s, e in test_splits.items()},
        write_predictions=write_predictions,
        summarize=summarize,
        save_files=save_files,
    )


register_task("glue_mlm", check=check_mlm_config)(build_mlm_task)


def _register(name: str) -> None:
    def check(config: Any) -> None:
        check_finetune_config(name, config)

    def build(config: Any, output_dir: str | None = None) -> Task:
        return build_finetune_task(name, config, output_dir)

    build.__doc__ = f"GLUE {name} fine-tuning (see glue.tasks.build_finetune_task)."
    register_task(f"glue_{name}", check=check)(build)


for _name in GLUE_TASK_NAMES:
    _register(_name)
