"""Byte-level BPE tokenizer (the ``tokenizers`` package) with the GLUE special tokens.

Special tokens take the first ids, in this order: ``<pad>`` = 0 (the encoder's padding
convention), ``<cls>`` = 1, ``<sep>`` = 2, ``<mask>`` = 3, ``<unk>`` = 4. A byte-level
model starts from all 256 bytes, so ``<unk>`` never occurs in encoded text; it is kept
so that the vocabulary layout matches RoBERTa's five special tokens (paper vocabulary
50,265 = RoBERTa's). Ordinary tokens are ids ``NUM_SPECIAL .. vocab_size - 1``.

Text is always plain text: the literal string ``<pad>`` (or ``<mask>``, ``<sep>`` ...)
in a document or a GLUE sentence is encoded as ordinary bytes, never as the special id.
Otherwise a sentence quoting ``<pad>`` would hold padding in its middle (masked out of
attention and pooling), and ``<mask>`` / ``<sep>`` would fake MLM targets or sentence
boundaries. ``tokenizers`` does this with ``Tokenizer.encode_special_tokens = True``,
which only stops special tokens from being matched in the input: text without the
literals encodes to the same ids, so tokenizers and checkpoints made before stay valid.
The flag is not stored in ``tokenizer.json``, so every tokenizer made or loaded here
gets it (:func:`plain_text_only`), and :func:`encode_texts` sets it again for a
tokenizer that came from elsewhere. Training (``BpeTrainer``) never matches special
tokens in its input, so literals there were always counted as ordinary text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sbm_jax.training.errors import ConfigError

PAD, CLS, SEP, MASK, UNK = "<pad>", "<cls>", "<sep>", "<mask>", "<unk>"
SPECIAL_TOKENS = (PAD, CLS, SEP, MASK, UNK)
NUM_SPECIAL = len(SPECIAL_TOKENS)
# 256 byte symbols plus the special tokens: the smallest byte-level vocabulary.
MIN_VOCAB_SIZE = 256 + NUM_SPECIAL
TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens in a loaded tokenizer."""

    pad: int
    cls: int
    sep: int
    mask: int
    unk: int

    def as_tuple(self) -> tuple[int, ...]:
        return (self.pad, self.cls, self.sep, self.mask, self.unk)


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """The special-token ids; raises if the tokenizer lacks one of them."""
    ids = []
    for token in SPECIAL_TOKENS:
        idx = tokenizer.token_to_id(token)
        if idx is None:
            raise ValueError(
                f"tokenizer has no special token {token!r}; it must define {SPECIAL_TOKENS}"
            )
        ids.append(idx)
    return SpecialIds(*ids)


def plain_text_only(tokenizer: Tokenizer) -> Tokenizer:
    """Make ``tokenizer`` encode special-token literals in text as ordinary text (see the
    module docstring); returns it."""
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A SHA-256 of what decides the ids of a text: the model (vocabulary and merges),
    the added tokens, the normalizer and the pre-tokenizer.

    Two files with the same fingerprint encode every text to the same ids; the decoder,
    padding and post-processor settings do not enter (they do not change ``encode``'s
    ids without special tokens). Computed from the loaded tokenizer, so two copies saved
    by different ``tokenizers`` versions still compare equal.
    """
    saved = json.loads(tokenizer.to_str())
    keys = ("model", "added_tokens", "normalizer", "pre_tokenizer")
    canonical = json.dumps({k: saved.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, field: str = "vocab_size"
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    Args:
      texts: documents (any iterable of strings).
      vocab_size: target vocabulary size including the special tokens (at least
        ``MIN_VOCAB_SIZE``); a small corpus may give fewer merges, so the result can be
        smaller.
      min_frequency: a pair must occur this often to be merged.
      field: config field named in errors.

    Returns:
      The trained ``tokenizers.Tokenizer`` (special tokens at ids 0..4).
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"{field}={vocab_size!r} must be an integer >= {MIN_VOCAB_SIZE} "
            f"(256 bytes + {NUM_SPECIAL} special tokens)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    special_ids(tokenizer)  # checks the layout
    return plain_text_only(tokenizer)


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> str:
    """Write ``<directory>/tokenizer.json``; returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENIZER_FILE)
    tokenizer.save(path)
    return path


def load_tokenizer(path: str, flag: str = "--tokenizer") -> Tokenizer:
    """Load a ``tokenizer.json`` (or a directory holding one).

    Args:
      path: file path, or a directory containing ``tokenizer.json``.
      flag: the command-line flag or config field named in errors.
    """
    if path and os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}={path!r}: no tokenizer file there")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ValueError(f"{flag}={path!r} is not a valid tokenizer.json: {e}") from None
    special_ids(tokenizer)
    return plain_text_only(tokenizer)


def check_pretraining_tokenizer(tokenizer: Tokenizer, path: str, run_tokenizer: str) -> None:
    """Refuse a ``data.tokenizer`` that differs from the pretraining run's tokenizer.

    The encoder's embeddings are indexed by the ids of the tokenizer it was pretrained
    with; another tokenizer of no larger size would load silently and feed it ids that
    mean other tokens. ``run_tokenizer`` is the ``tokenizer.json`` beside
    ``config.init_from``'s run (the pretraining run saves the one it used there, also
    when it was given ``data.tokenizer``). Files are compared by
    :func:`tokenizer_fingerprint`, so a copy passes. A run without that
    file (a checkpoint copied on its own) cannot be checked: that is said, not refused,
    since giving ``data.tokenizer`` is then the only way to fine-tune it.
    """
    if not os.path.isfile(run_tokenizer):
        print(
            f"warning: config.data.tokenizer={path!r} is not checked against the pretraining "
            f"tokenizer: config.init_from's run has no {run_tokenizer!r}",
            flush=True,
        )
        return
    pretrained = load_tokenizer(run_tokenizer, flag="the tokenizer.json of config.init_from's run")
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(pretrained):
        raise ConfigError(
            f"config.data.tokenizer={path!r} is not the tokenizer the encoder was pretrained "
            f"with ({run_tokenizer!r}, beside config.init_from's run): its ids would mean "
            "other tokens; leave config.data.tokenizer empty to use the run's"
        )


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as plain text: no special tokens are added, and none are
    matched in the text (a literal ``<pad>`` is ordinary bytes, see the module docstring).

    The one place the GLUE code encodes text (pretraining corpus and fine-tuning
    sentences), so the rule holds for a tokenizer not loaded by :func:`load_tokenizer`.
    """
    plain_text_only(tokenizer)
    return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
