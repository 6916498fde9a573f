"""What every config shares: the preset parser and the table of attention options.

A preset is the string after the colon of ``--config=<file>:<preset>``, comma-separated
parts in any order (spaces ignored, a later part of a kind overrides an earlier one):

  mechanism  an attention preset the config accepts (``sbm``, ``full``, ``performer``...,
             or a variant of ``VARIANTS``: ``sbm_poisson``, ``sbm_nowindow``, ``sbm_pairs``)
  scale      a scale the config accepts (``paper``, ``reduced``, ``smoke``; the synthetic
             task calls its CPU scale ``quick``)
  lambda=X   weight of SBM's density regulariser (train.density_lambda), where accepted
  seed=N     the run's seed, where accepted
  task=NAME  the GLUE task to fine-tune, where accepted

``parse_preset`` reads it; ``attention_options`` turns (mechanism, scale, length) into
``model.attention_options`` from ``OPTIONS``, the one table of each mechanism's option
values per scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

# The scales of OPTIONS. Each config maps its own scale names onto them (synthetic:
# quick -> reduced; GLUE: smoke -> glue_smoke).
SCALES = ("paper", "reduced", "smoke", "glue_smoke")
KEYS = ("lambda", "seed", "task")  # the key=value parts a config may accept


@dataclasses.dataclass(frozen=True)
class Preset:
    """A parsed preset string."""

    mechanism: str  # attention preset (a registry name or a VARIANTS name)
    scale: str  # the config's own scale name (not yet mapped onto SCALES)
    lam: float = 0.0  # lambda=X: weight of the density regulariser
    seed: int = 0  # seed=N: the run's seed
    task: str = ""  # task=NAME: GLUE task ("" when not given)


class PresetListing(Exception):  # noqa: N818 (a signal to the caller, not an error)
    """What a config accepts, raised by :func:`parse_preset` under :func:`listing`
    (the trainer's ``--list_presets``) instead of parsing."""

    def __init__(
        self, mechanisms: Sequence[str], scales: Sequence[str], keys: Sequence[str], default: str
    ):
        super().__init__("preset listing")
        self.mechanisms, self.scales, self.keys = tuple(mechanisms), tuple(scales), tuple(keys)
        self.default_mechanism = default


_LISTING = [False]


class listing:  # noqa: N801 (a context manager used as ``with presets.listing():``)
    """Within it, :func:`parse_preset` raises :class:`PresetListing` with the words it
    would accept: how ``--list_presets`` reads any config's presets without each
    config listing them a second time."""

    def __enter__(self) -> None:
        _LISTING[0] = True

    def __exit__(self, *exc: Any) -> None:
        _LISTING[0] = False


def parse_preset(
    arg: str | None,
    *,
    mechanisms: Sequence[str],
    scales: Sequence[str],
    keys: Sequence[str] = (),
    default_mechanism: str = "sbm",
) -> Preset:
    """``"sbm,smoke,lambda=1e-2,seed=1"`` -> Preset("sbm", "smoke", 0.01, 1).

    ``mechanisms`` and ``scales`` are the words this config accepts (the first scale is
    the default), ``keys`` the ``key=value`` parts (a subset of ``KEYS``).

    Raises:
      ValueError naming the bad part and what is accepted instead, or the two parts
      that set the same thing (two mechanisms, two scales, two seeds...).
    """
    if _LISTING[0]:
        raise PresetListing(mechanisms, scales, keys, default_mechanism)
    unknown = set(keys) - set(KEYS)
    if unknown:
        raise ValueError(f"parse_preset: keys {sorted(unknown)} are not among {KEYS}")
    mechanism, scale, lam, seed, task = default_mechanism, scales[0], 0.0, 0, ""
    given: dict[str, str] = {}  # what kind of part was given, by which part

    def once(kind: str, part: str) -> None:
        # "sbm,full" or "smoke,paper" would silently keep the last one.
        if kind in given:
            raise ValueError(f"presets {given[kind]!r} and {part!r} in {arg!r} both set the {kind}")
        given[kind] = part

    for part in (arg or "").replace(" ", "").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key if sep else ""
        if part in mechanisms:
            once("mechanism", part)
            mechanism = part
        elif part in scales:
            once("scale", part)
            scale = part
        elif key == "lambda" and "lambda" in keys:
            once("lambda", part)
            try:
                lam = float(value)
            except ValueError:
                raise ValueError(f"preset {part!r}: lambda must be a number") from None
            if lam < 0:
                raise ValueError(f"preset {part!r}: lambda must be >= 0")
        elif key == "seed" and "seed" in keys:
            once("seed", part)
            try:
                seed = int(value)
            except ValueError:
                raise ValueError(f"preset {part!r}: seed must be an integer") from None
        elif key == "task" and "task" in keys:
            once("task", part)
            task = value
        else:
            forms = {"lambda": "lambda=<float>", "seed": "seed=<int>", "task": "task=<name>"}
            extra = "".join(f", {forms[k]}" for k in keys)
            raise ValueError(
                f"unknown preset {part!r} in {arg!r}; accepted: mechanisms {tuple(mechanisms)}, "
                f"scales {tuple(scales)}{extra}"
            )
    return Preset(mechanism, scale, lam, seed, task)


_INHERIT: Any = object()  # marks a scale that takes the value of the scale before it


def _seq_len(n: int) -> int:
    return n


def _seq_len_squared(n: int) -> int:
    return n * n


def _unset_float(n: int) -> ml_collections.FieldReference:
    del n
    return ml_collections.config_dict.placeholder(float)  # None, settable to a float


@dataclasses.dataclass(frozen=True)
class Scaled:
    """One option's value at each scale of ``SCALES``: ``reduced`` takes ``paper``'s
    unless given, ``smoke`` takes ``reduced``'s, ``glue_smoke`` takes ``smoke``'s. A
    callable value is called with the sequence length.

    ``shown``: whether ``attention_options`` sets the option by default; False: only
    where a config names it in ``fields`` (elsewhere the layer's default applies)."""

    paper: Any
    reduced: Any = _INHERIT
    smoke: Any = _INHERIT
    glue_smoke: Any = _INHERIT
    shown: bool = True

    def at(self, scale: str, seq_len: int) -> Any:
        """The value at ``scale`` for inputs of ``seq_len`` tokens."""
        chain = SCALES[: SCALES.index(scale) + 1]
        value = next(v for v in (getattr(self, s) for s in reversed(chain)) if v is not _INHERIT)
        return value(seq_len) if callable(value) else value


# mechanism -> option -> its value per scale. Paper values: the SBM-Transformer paper
# (k=128 clusters, 256 landmarks / random features / projection length, 2 hashing
# rounds; its GLUE model adds a local window of 64) and the reference code (Nystromformer
# conv 35, Reformer chunks 64); reduced: the paper's sizes at CPU lengths; smoke: tiny.
# Full attention: exact softmax attention, "auto" (chunked on CPU and TPU past one block,
# cuDNN flash attention on a GPU in bf16/fp16 without attention dropout; see
# sbm_jax/attention/full.py), so that the baseline is the one a careful user runs and fits
# at Path-X's n=16384 on a CPU. Mechanisms without an entry (linear, sparse_fixed,
# sparse_strided) have no options.
OPTIONS: dict[str, dict[str, Scaled]] = {
    "full": {
        "implementation": Scaled("auto"),  # "auto", "chunked", "cudnn" or "xla" (naive)
        # queries per block of "chunked"; 0: 2^19 // length, in [16, 512] (the fastest
        # block on CPU, sbm_jax.attention.full.default_query_chunk)
        "query_chunk": Scaled(0),
    },
    "sbm": {
        "num_clusters": Scaled(128, smoke=8, glue_smoke=4),  # k, clusters per head (paper: 128)
        "delta": Scaled(0.01),  # exploration probability added to every pair (training only)
        "edge_law": Scaled("bernoulli"),  # "bernoulli" (the paper's SBM) or "poisson" (raw fastRG)
        "self_loops": Scaled(False),  # add (i, i) for every real token (the "+I" theory variant)
        "shared_mlp": Scaled(False, shown=False),  # one query/key MLP for all heads vs per head
        # Local window unioned with the sampled graph, |i - j| <= window // 2 (paper GLUE: 64).
        "window": Scaled(64, glue_smoke=4, shown=False),
        "impl": Scaled("auto", smoke="dense"),  # "auto", "sparse" (edge lists) or "dense" path
        # "auto" takes the dense path when length**2 <= dense_below; at the reduced scale
        # (CPU runs) dense is the faster path, so it takes it; the graph law is the same.
        "dense_below": Scaled(0, reduced=_seq_len_squared, smoke=0),
        # "auto": skip buckets whose slots x edge_cost >= length**2; unset (None): the cost
        # model's calibrated value for the backend and kernel (sbm_jax/kernels/cost.py).
        "edge_cost": Scaled(_unset_float, shown=False),
        # sparse path's kernel: "auto" (fused on CPU, rows elsewhere), "fused", "rows",
        # "segment" or "triton" (sbm_jax/kernels/)
        "kernel": Scaled("auto", shown=False),
        "cluster_init": Scaled("paper"),  # C init: "paper" (fan-in d_h) or "reference" (k*d_h)
        # mask estimator: "paper" (eq. 9), "reference" (released code) or "pairs" (ours:
        # unsampled pairs get a gradient too; docs/synthetic.md)
        "ste": Scaled("paper"),
    },
    "nystromformer": {
        "num_landmarks": Scaled(256, smoke=4),  # landmarks (paper: 256)
        "conv_kernel_size": Scaled(35, smoke=3),  # depthwise conv on values (reference: 35; 0: off)
    },
    "performer": {
        "num_features": Scaled(256, smoke=16, glue_smoke=8),  # random features (paper: 256)
    },
    "linformer": {
        "proj_len": Scaled(256, smoke=8),  # projected length (paper: 256)
        "max_len": Scaled(_seq_len),  # length of the E/F projections = the padded length
    },
    "reformer": {
        "num_hashes": Scaled(2),  # hashing rounds (paper: 2)
        "chunk_len": Scaled(64, smoke=8),  # LSH chunk length (reference: 64)
    },
    "local": {
        "window": Scaled(64, smoke=8, glue_smoke=4),  # attention window, |i - j| <= window // 2
    },
    "tsa": {  # the TSA paper's settings (docs/tsa.md); the LRA presets keep the defaults
        "damping": Scaled(0.9, shown=False),  # c in Omega = c^|l1 - l2| (docs/tsa.md)
        "projection": Scaled("tt", shown=False),  # "tt" (MPO layers, QTT) or "dense"
        "tt_rank": Scaled(2, shown=False),  # TT ranks R_n (QTT: 2)
    },
}

# Preset mechanisms that are a registered mechanism with some options fixed.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sbm_poisson": ("sbm", {"edge_law": "poisson"}),  # the raw fastRG edge law
    "sbm_nowindow": ("sbm", {"window": 0}),  # GLUE's SBM without the local window
    # Our estimator (not the paper's eq. 9): every pair, sampled or not, gets its
    # first-order gain. Run on the dense path, where that sum is exact and where it was
    # measured (the sparse path estimates it from probes; docs/synthetic.md, "The pairs
    # estimator").
    "sbm_pairs": ("sbm", {"ste": "pairs", "impl": "dense"}),
}


def registry_name(mechanism: str) -> str:
    """The attention registry name of a preset mechanism (``sbm_poisson`` -> ``sbm``)."""
    return VARIANTS[mechanism][0] if mechanism in VARIANTS else mechanism


def attention_options(
    mechanism: str,
    scale: str,
    seq_len: int,
    *,
    fields: Iterable[str] | None = None,
    **overrides: Any,
) -> ml_collections.ConfigDict:
    """``model.attention_options`` of preset ``mechanism`` at ``scale`` (one of
    ``SCALES``) for inputs of ``seq_len`` tokens, in the table's order.

    ``fields``: the options to set (default: those ``shown``); ``overrides``: values that
    replace the table's (a variant's fixed values come before them).
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {SCALES}")
    table = OPTIONS.get(registry_name(mechanism), {})
    wanted = set(fields) if fields is not None else {k for k, v in table.items() if v.shown}
    missing = wanted - set(table)
    if missing:
        raise ValueError(f"{mechanism!r} has no options {sorted(missing)}; it has {list(table)}")
    stray = set(overrides) - wanted
    if stray:
        raise ValueError(
            f"overrides {sorted(stray)} are not among the fields set: {sorted(wanted)}"
        )
    values = {**VARIANTS.get(mechanism, ("", {}))[1], **overrides}
    options = ml_collections.ConfigDict()
    for name, row in table.items():
        if name in wanted:
            options[name] = values[name] if name in values else row.at(scale, seq_len)
    return options
