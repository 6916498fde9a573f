"""The masked-language-modelling task: corpus -> tokenizer -> packed sequences -> Task.

Batch of training step ``s``: rows of the training sequences picked by an
:class:`glue.data.EpochStream` (seed ``config.seed``), masked with
``numpy.random.default_rng([seed, 1, s])``; held-out sequences are masked once with
stream 2, so every evaluation scores the same corrupted tokens. Loss and accuracy are
over the scored (masked) positions only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from glue import corpus as corpus_lib
from glue.data import EpochStream
from glue.masking import mask_tokens
from glue.models import build_mlm_model, mlm_model_inputs
from glue.tokenizer import (
    NUM_SPECIAL,
    TOKENIZER_FILE,
    SpecialIds,
    check_pretraining_tokenizer,
    encode_texts,
    load_tokenizer,
    special_ids,
    train_tokenizer,
)
from sbm_jax.training.checkpoints import find_checkpoint, run_dir_of_checkpoint
from sbm_jax.training.config_checks import ConfigError
from sbm_jax.training.run_dir import write_atomically
from sbm_jax.training.task import Batch, Task, classification_loss

_TRAIN_STREAM = 1
_EVAL_STREAM = 2


def load_documents(config: Any) -> list[str]:
    """Documents from ``data.corpus`` (local glob: one per blank-line-separated block)
    or ``data.tfds_name`` (one per example); at most ``data.max_documents`` (0: all)."""
    data = config.data
    if data.corpus:
        docs = corpus_lib.read_local_corpus(str(data.corpus), flag="config.data.corpus")
    elif data.tfds_name:
        docs = list(
            corpus_lib.iter_tfds_corpus(
                str(data.tfds_name),
                str(data.tfds_split),
                str(data.tfds_text_key),
                data_dir=str(data.tfds_data_dir) or None,
                max_documents=int(data.max_documents),
                download=bool(data.tfds_download),
            )
        )
    else:
        raise ValueError(
            "data.corpus is empty and so is data.tfds_name: give --config.data.corpus='text/*.txt'"
            " or a TFDS text builder"
        )
    if int(data.max_documents) > 0:
        docs = docs[: int(data.max_documents)]
    return docs


def init_run_tokenizer(config: Any) -> str:
    """The ``tokenizer.json`` beside ``config.init_from``'s run ('' without init_from)."""
    if not config.get("init_from"):
        return ""
    run_dir = run_dir_of_checkpoint(find_checkpoint(str(config.init_from)))
    return os.path.join(run_dir, TOKENIZER_FILE)


def prepare_tokenizer(config: Any, documents: list[str], run_dir: str | None = None) -> Tokenizer:
    """The run's tokenizer: the one a resumed run saved in ``run_dir``; else, continuing
    from ``config.init_from``, that run's (``data.tokenizer`` may name a copy of it, no
    other: the loaded embeddings and MLM head are indexed by its ids); else
    ``data.tokenizer``; else one trained on ``documents`` (``model.vocab_size``)."""
    saved = os.path.join(run_dir, TOKENIZER_FILE) if run_dir else ""
    if saved and os.path.isfile(saved):
        return load_tokenizer(saved, flag="the run's tokenizer.json")
    run_tokenizer = init_run_tokenizer(config)
    if config.data.tokenizer:
        path = str(config.data.tokenizer)
        tokenizer = load_tokenizer(path, flag="config.data.tokenizer")
        if run_tokenizer:
            check_pretraining_tokenizer(tokenizer, path, run_tokenizer)
        return tokenizer
    if run_tokenizer:
        if not os.path.isfile(run_tokenizer):
            raise ConfigError(
                f"config.init_from={str(config.init_from)!r}: its run has no {run_tokenizer!r}, "
                "so the ids of its embeddings are unknown; pass --config.data.tokenizer=<the "
                "tokenizer.json it was pretrained with>"
            )
        return load_tokenizer(run_tokenizer, flag="the tokenizer.json of config.init_from's run")
    return train_tokenizer(
        documents,
        int(config.model.vocab_size),
        int(config.data.tokenizer_min_frequency),
        field="model.vocab_size",
    )


@dataclasses.dataclass
class MlmData:
    """Packed sequences of a corpus.

    Attributes:
      train: int32 [num_train, max_len]; eval: int32 [num_eval, max_len].
      special: special-token ids; vocab_size: tokenizer vocabulary size.
      num_tokens: non-padding tokens in all sequences.
    """

    train: np.ndarray
    eval: np.ndarray
    special: SpecialIds
    vocab_size: int
    num_tokens: int


def pack_corpus(config: Any, tokenizer: Tokenizer, documents: list[str]) -> MlmData:
    """Tokenise, pack to ``data.max_len`` and hold out ``data.eval_fraction``."""
    special = special_ids(tokenizer)
    packed = corpus_lib.pack_sequences(
        encode_texts(tokenizer, documents),
        int(config.data.max_len),
        special.cls,
        special.sep,
        special.pad,
    )
    rng = np.random.default_rng([int(config.seed), 0])
    packed = packed[rng.permutation(len(packed))]
    num_eval = int(round(float(config.data.eval_fraction) * len(packed)))
    num_eval = min(max(num_eval, 1 if len(packed) > 1 else 0), int(config.data.eval_sequences_max))
    return MlmData(
        train=packed[num_eval:],
        eval=packed[:num_eval],
        special=special,
        vocab_size=tokenizer.get_vocab_size(),
        num_tokens=int(np.sum(packed != special.pad)),
    )


#: In the run directory, beside tokenizer.json: the fingerprint of the packed sequences
#: the run started with, so that a resumed run is refused when its corpus changed.
DATA_FINGERPRINT_FILE = "mlm_data_fingerprint.json"


def data_fingerprint(data: MlmData) -> dict[str, Any]:
    """SHA-256 and shapes of the packed training and held-out sequences (in order), and
    the version of ``tokenizers`` that encoded them (not part of the digest: it names a
    likely cause when the digest changes)."""
    digest = hashlib.sha256()
    for array in (data.train, data.eval):
        digest.update(repr((array.dtype.str, array.shape)).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return {
        "sha256": digest.hexdigest(),
        "train_shape": list(data.train.shape),
        "eval_shape": list(data.eval.shape),
        "tokenizers_version": tokenizers.__version__,
    }


def save_data_fingerprint(data: MlmData, directory: str) -> str:
    """Write :data:`DATA_FINGERPRINT_FILE` in ``directory``; returns its path."""
    path = os.path.join(directory, DATA_FINGERPRINT_FILE)
    write_atomically(path, json.dumps(data_fingerprint(data), indent=2, sort_keys=True))
    return path


def check_data_fingerprint(config: Any, data: MlmData, run_dir: str | None) -> None:
    """Refuse to resume a run in ``run_dir`` whose packed sequences differ from ``data``.

    The corpus is read again on every session; files changed under the same
    ``data.corpus`` glob (or another TFDS version) would pack into other sequences and
    batches, silently. A run made before the fingerprint existed is accepted with a note
    (it gets the fingerprint of this session's data).
    """
    if not run_dir:
        return
    path = os.path.join(run_dir, DATA_FINGERPRINT_FILE)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(run_dir, TOKENIZER_FILE)):
            print(
                f"note: {run_dir!r} has no {DATA_FINGERPRINT_FILE} (a run from before it was "
                "recorded): the corpus cannot be checked against the one the run started with",
                flush=True,
            )
        return
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path!r} is unreadable ({e}); the corpus cannot be checked") from None
    current = data_fingerprint(data)
    if saved.get("sha256") != current["sha256"]:
        source = (
            f"config.data.corpus={str(config.data.corpus)!r}"
            if config.data.corpus
            else f"config.data.tfds_name={str(config.data.tfds_name)!r}"
        )
        then = saved.get("tokenizers_version")
        if then is not None and then != current["tokenizers_version"]:
            # the same corpus encoded by another tokenizers release packs differently too
            source = (
                f"{source} or the tokenizers library (version {then} then, "
                f"{current['tokenizers_version']} now)"
            )
        raise ConfigError(
            f"{source} changed since the run in {run_dir!r} started (its packed sequences "
            f"differ from {DATA_FINGERPRINT_FILE}: train shape {saved.get('train_shape')} "
            f"then, {current['train_shape']} now): resuming would train on other data; "
            "restore the corpus or choose another --output_dir"
        )


def _masking_kwargs(config: Any, data: MlmData) -> dict[str, Any]:
    return {
        "special_ids": data.special.as_tuple(),
        "pad_id": data.special.pad,
        "mask_id": data.special.mask,
        "random_low": NUM_SPECIAL,
        "random_high": data.vocab_size,
        "max_predictions": int(config.data.max_predictions),
        "mask_rate": float(config.data.mask_rate),
        "mask_token_rate": float(config.data.mask_token_rate),
        "random_token_rate": float(config.data.random_token_rate),
    }


def build_mlm_task_from_data(config: Any, data: MlmData) -> Task:
    """The MLM ``Task`` over already packed sequences."""
    if len(data.train) == 0:
        raise ValueError("the corpus packs into no training sequences; give --corpus more text")
    seed = int(config.seed)
    batch_size = int(config.train.batch_size)
    kwargs = _masking_kwargs(config, data)
    stream = EpochStream(len(data.train), batch_size, seed)

    def train_batches(start_step: int) -> Iterator[Batch]:
        for step, idx in enumerate(stream.iterate(start_step), start=start_step):
            yield mask_tokens(
                np.random.default_rng([seed, _TRAIN_STREAM, step]), data.train[idx], **kwargs
            )

    eval_batches = None
    if len(data.eval):
        held_out = []
        for i, start in enumerate(range(0, len(data.eval), batch_size)):
            rows = np.arange(start, start + batch_size)
            real = rows < len(data.eval)
            rows = np.where(real, rows, rows % len(data.eval))  # pad by repeating real rows
            batch = mask_tokens(
                np.random.default_rng([seed, _EVAL_STREAM, i]), data.eval[rows], **kwargs
            )
            batch["weights"] = batch["weights"] * real[:, None]
            batch["example_mask"] = real
            held_out.append(batch)

        def eval_batches() -> list[Batch]:
            return held_out

    return Task(
        name="glue_mlm",
        head="token",
        train_batches=train_batches,
        eval_batches=eval_batches,
        loss_fn=classification_loss,
        model_inputs=mlm_model_inputs,
        make_model=build_mlm_model,
    )
