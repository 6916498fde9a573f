"""One registry for attention mechanisms, keyed by the name a config uses.

Contract every registered mechanism keeps (the encoder relies on it):

* It is a ``flax.linen.Module`` whose constructor takes the keyword fields
  ``num_heads: int``, ``head_dim: int``, ``out_dim: int`` (model width),
  ``attention_dropout: float`` and ``dtype`` (compute dtype), plus its own options
  (each with a default), which come from ``config.model.attention_options``.
  ``SBMAttention`` alone also has defaults for them (``out_dim=None``: the input
  width), so ``SBMAttention(num_heads=2, head_dim=32)`` works standalone; the others
  need ``out_dim``.
* ``__call__(x, mask, *, deterministic)`` with ``x [batch, length, dim]`` and
  ``mask [batch, length]`` (bool, True for real tokens) returns
  ``[batch, length, out_dim]``. Padded positions never influence real positions.
  (``SBMAttention`` defaults ``mask=None``, all real, and ``deterministic=True``.)
  Bad shared fields and input shapes are a ValueError naming them, raised before
  anything is traced (``sbm_jax.attention._projections.check_call``).
* Randomness only from the named rng streams ``dropout`` and ``sample``.
* Statistics for logging go to the ``attention_stats`` collection with ``self.sow``,
  where the mechanism has them (mechanisms that never form a graph or weights, such
  as linear, linformer, nystromformer, performer and reformer, sow nothing):
  ``density [batch, heads]`` (differentiable where the mechanism's density is, e.g.
  SBM through the straight-through estimator) and ``edges [batch, heads]``. A mechanism
  may sow more entries under other names; the trainer reads ``density``, ``edges`` and
  ``overflow`` by name and ignores the rest (unused entries cost nothing under ``jit``).
  SBM adds ``overflow [batch, heads]`` bool, ``path []`` and the per-token expected
  densities ``query_density`` and ``key_density [batch, heads, length]`` (0 at padded
  positions), which reports read instead of re-deriving the layer.
* Larger per-token arrays go to a separate collection that is sown only when the
  caller makes it mutable (``self.is_mutable_collection``), so they cost nothing
  otherwise: SBM sows ``q_memberships``, ``k_memberships [batch, heads, length, k]``
  and ``block [heads, k, k]`` into ``attention_maps``
  (``sbm_jax.attention.sbm.MAPS_COLLECTION``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import flax.linen as nn

STATS_COLLECTION = "attention_stats"

#: Constructor fields every mechanism takes from the encoder (the contract above); the
#: rest of its dataclass fields are its options.
COMMON_FIELDS = ("num_heads", "head_dim", "out_dim", "attention_dropout", "dtype")
_FLAX_FIELDS = ("parent", "name")


class FlopsFn(Protocol):
    """Analytic FLOPs of one layer on one example: ``{op: flops}``, projections included.

    ``n, D, H, d``: length, model width, heads, head width; ``options``: every option of
    the mechanism (defaults filled in); ``density``: SBM's sampled fraction of the n^2
    pairs (None: 1.0), ignored by the others. Conventions: ``sbm_jax.analysis.flops``.
    """

    def __call__(
        self, n: int, D: int, H: int, d: int, options: Mapping[str, Any], density: float | None
    ) -> dict[str, float]: ...


class ParamsFn(Protocol):
    """Analytic parameter count of one layer for inputs ``[*, n, D]`` (see ``FlopsFn``)."""

    def __call__(self, n: int, D: int, H: int, d: int, options: Mapping[str, Any]) -> int: ...


class ConfigCheckFn(Protocol):
    """A mechanism's own check of a training run, beyond its options' ``validate()``:
    given the module as the encoder builds it, every ``(what, rows)`` batch the run
    traces the layer with (``"the training micro-batch"``, 16) and the longest input
    length, the problems found, each a message naming the config fields (``[]``: none).
    Run by the trainer's config check before anything is built or compiled."""

    def __call__(
        self, module: nn.Module, batches: Sequence[tuple[str, int]], length: int
    ) -> list[str]: ...


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """What is known about one registered attention mechanism.

    Attributes:
      name: the name configs use (``model.attention``).
      module: the ``flax.linen.Module`` class (the contract above).
      flops: its analytic FLOPs (:class:`FlopsFn`), or None if it has no formula.
      params: its analytic parameter count (:class:`ParamsFn`), or None.
      length_options: options a task sizes to its padded length ``n`` (e.g. Linformer's
        ``max_len``), or None.
      config_check: its check of a run's batch sizes (:class:`ConfigCheckFn`), or None;
        set by :func:`register_config_check`.
    """

    name: str
    module: type[nn.Module]
    flops: FlopsFn | None = None
    params: ParamsFn | None = None
    length_options: Callable[[int], dict[str, Any]] | None = None
    config_check: ConfigCheckFn | None = None

    def option_defaults(self) -> dict[str, Any]:
        """``{option: default}`` from the module's dataclass fields (common fields left out)."""
        defaults = {}
        for key, field in _fields(self.module).items():
            if key in _FLAX_FIELDS or key in COMMON_FIELDS:
                continue
            if field.default is not dataclasses.MISSING:
                defaults[key] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                defaults[key] = field.default_factory()
        return defaults

    def option_type(self, option: str) -> type | None:
        """The value type of an option whose default may be None (``c: int | None``):
        ``int``, ``float``, ``str`` or ``bool`` from the field's annotation; None when the
        annotation names none of them (or the option does not exist)."""
        field = _fields(self.module).get(option)
        if field is None:
            return None
        names = field.type if isinstance(field.type, str) else repr(field.type)
        words = set(re.findall(r"[A-Za-z_]+", names))
        for kind in (bool, int, float, str):  # bool first: "bool | None" is not an int
            if kind.__name__ in words:
                return kind
        return None

    def check_options(
        self,
        options: Mapping[str, Any] | None,
        *,
        given: Collection[str] = (),
        field: str = "model.attention_options",
    ) -> dict[str, Any]:
        """``options`` as a dict, after checking each name is a field of the module.

        ``given`` are the fields passed besides the options (they cannot be options too);
        an unknown name fails with a ValueError naming ``<field>.<option>``.
        """
        options = dict(options or {})
        known = set(_fields(self.module)) - set(_FLAX_FIELDS) - set(given)
        for key in options:
            if key not in known:
                raise ValueError(
                    f"{field}.{key} is not an option of attention {self.name!r}; "
                    f"its options are {sorted(known)}"
                )
        return options

    def resolve_options(
        self, options: Mapping[str, Any] | None, *, field: str = "model.attention_options"
    ) -> dict[str, Any]:
        """The option defaults overridden by ``options`` (checked as in :meth:`check_options`).

        The shape fields ``num_heads``, ``head_dim`` and ``out_dim`` are not options here.
        """
        given = ("num_heads", "head_dim", "out_dim")
        return {**self.option_defaults(), **self.check_options(options, given=given, field=field)}


_REGISTRY: dict[str, Mechanism] = {}


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return dict(getattr(cls, "__dataclass_fields__", {}))


def register(
    name: str,
    *,
    flops: FlopsFn | None = None,
    params: ParamsFn | None = None,
    length_options: Callable[[int], dict[str, Any]] | None = None,
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator that registers an attention module under ``name``.

    ``flops``, ``params`` and ``length_options`` become the fields of its
    :class:`Mechanism` entry; the option defaults come from the class's fields.
    """

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _REGISTRY and _REGISTRY[name].module is not cls:
            raise ValueError(f"attention mechanism {name!r} is registered twice")
        missing = [k for k in COMMON_FIELDS if k not in _fields(cls)]
        if missing:
            raise TypeError(f"attention {name!r} ({cls.__name__}) lacks the fields {missing}")
        _REGISTRY[name] = Mechanism(name, cls, flops, params, length_options)
        return cls

    return wrap


def register_config_check(name: str) -> Callable[[ConfigCheckFn], ConfigCheckFn]:
    """Function decorator that hangs ``check`` (:class:`ConfigCheckFn`) on the registry
    entry of mechanism ``name`` (registered already), beside its FLOPs: the generic
    config check calls it, so mechanism knowledge stays in the mechanism's modules."""

    def wrap(check: ConfigCheckFn) -> ConfigCheckFn:
        entry = get_mechanism(name)
        _REGISTRY[name] = dataclasses.replace(entry, config_check=check)
        return check

    return wrap


# The built-in mechanisms need no import here: Python runs the package's __init__ (which
# imports every mechanism module, each registering itself) before this module can be
# reached as ``sbm_jax.attention.registry``, so the registry is full by the time any of
# these functions runs.


def available() -> list[str]:
    """Sorted names of every registered mechanism."""
    return sorted(_REGISTRY)


def get_mechanism(name: str, field: str = "model.attention") -> Mechanism:
    """The registry entry of ``name``; the error names the config ``field``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"{field}={name!r} is not a known attention mechanism; choose one of {available()}"
        ) from None


def get_attention(name: str, field: str = "model.attention") -> type[nn.Module]:
    """The module class registered as ``name``; the error names the config ``field``."""
    return get_mechanism(name, field).module


def option_defaults(name: str) -> dict[str, Any]:
    """``{option: default}`` of mechanism ``name`` (its module's fields, common ones left out)."""
    return get_mechanism(name).option_defaults()


def build_attention(
    name: str,
    *,
    options: dict[str, Any] | None = None,
    option_field: str = "model.attention_options",
    **fields: Any,
) -> nn.Module:
    """Instantiate mechanism ``name`` with the common ``fields`` and its ``options``.

    Unknown option names fail with a message naming ``<option_field>.<opt>`` (by default
    ``model.attention_options.<opt>``, the config field they come from).
    """
    mechanism = get_mechanism(name)
    options = mechanism.check_options(options, given=fields, field=option_field)
    return mechanism.module(**fields, **options)
