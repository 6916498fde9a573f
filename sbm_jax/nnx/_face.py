"""The NNX face: one thin ``nnx.Module`` around a Linen module, sharing its math.

:class:`LinenFace` holds the Linen module (static), its parameters as ``nnx.Param``
attributes laid out exactly as the Linen ``params`` tree (each top-level Linen name is an
attribute, the rest nested dicts), the rng streams it draws from, and the statistics the
Linen module sowed in its last call. A call is one ``Module.apply`` of the Linen module
on those parameters: the forward and backward are the Linen ones, so the NNX face adds no
operation to the compiled program.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import flax.errors
import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta

from sbm_jax.attention.registry import STATS_COLLECTION

# Attributes of the face itself; a Linen parameter of the same top-level name would shadow
# one of them, so it is refused when the face is built.
_OWN_ATTRIBUTES = ("linen_module", "deterministic", "sample_rng", "dropout_rng", "stats")
_RNG_STREAMS = ("sample", "dropout")
_MISSING_RNG = re.compile(r'needs PRNG for "([^"]+)"')


class AttentionStats(nnx.Variable):
    """What the Linen module sowed into ``attention_stats`` in its last call (a dict:
    ``density``, ``edges`` and, for SBM, ``overflow``, ``path``, ...). Not a parameter:
    ``nnx.Optimizer(..., wrt=nnx.Param)`` and ``nnx.grad`` leave it alone."""


def _stream(rngs: nnx.Rngs | nnx.RngStream | None, name: str) -> nnx.RngStream | None:
    """A fork of stream ``name`` of ``rngs`` (falling back to ``default``, the NNX rule),
    or None when there is neither."""
    if rngs is None:
        return None
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    try:
        return rngs[name].fork()
    except KeyError:
        return None


def _get(rngs: nnx.Rngs, name: str) -> nnx.RngStream | None:
    try:
        return rngs[name]
    except KeyError:
        return None


def _params_key(rngs: nnx.Rngs | None, owner: str) -> jax.Array:
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"{owner} needs rngs=nnx.Rngs(...) to initialise its parameters")
    try:
        return rngs["params"]()
    except KeyError:
        raise ValueError(
            f"{owner}: rngs have no 'params' (nor 'default') stream to initialise the "
            "parameters; build them as nnx.Rngs(0, sample=1)"
        ) from None


def _to_param(tree: Any) -> Any:
    """A Linen params (sub)tree -> the same tree of ``nnx.Param``; a boxed leaf's logical
    axis names become the Param's ``out_sharding`` (what ``nnx.get_partition_spec``
    reads), without placing the value on a mesh now (``eager_sharding=False``)."""
    if isinstance(tree, meta.Partitioned):
        return nnx.Param(tree.value, out_sharding=tuple(tree.names), eager_sharding=False)
    if isinstance(tree, Mapping):
        return {str(k): _to_param(v) for k, v in tree.items()}
    return nnx.Param(tree)


def _unwrap_sown(tree: Any) -> Any:
    """``self.sow`` stores each value as a 1-tuple: the values themselves."""
    if isinstance(tree, Mapping):
        return {k: _unwrap_sown(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and len(tree) == 1:
        return tree[0]
    return tree


def _flat(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, (*prefix, str(key))))
        else:
            out[(*prefix, str(key))] = value
    return out


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", ()))


class LinenFace(nnx.Module):
    """An NNX module whose call is ``linen_module.apply`` on its own parameters.

    Args:
      linen_module: the Linen module (its fields fix the layer).
      sample_args: inputs to initialise the parameters with (a tiny batch: only their
        shapes' trailing dims matter to the parameter shapes).
      rngs: ``params`` (or ``default``) initialises the parameters; ``sample`` and
        ``dropout`` (each falling back to ``default``) feed the Linen streams of those
        names on every call.
      deterministic: the default of the call's ``deterministic`` (dropout off);
        ``Module.eval()`` / ``train()`` set it as for ``nnx.Dropout``.
      init_kwargs: keyword arguments of the initialising call.
    """

    def __init__(
        self,
        linen_module: nn.Module,
        sample_args: tuple[Any, ...],
        *,
        rngs: nnx.Rngs,
        deterministic: bool = False,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        owner = type(self).__name__
        key = _params_key(rngs, owner)
        # The init streams derive from the params key, so building a layer draws nothing
        # from the sample/dropout streams the calls use.
        init_rngs = {"params": key, "sample": key, "dropout": key}
        kwargs = dict(init_kwargs or {})
        # Eager, not jitted: the ops it runs are the ones the first call reuses, where a
        # jitted init would compile the whole forward once more only to keep the params.
        variables = linen_module.init(init_rngs, *sample_args, **kwargs)
        self.linen_module = linen_module
        self.deterministic = deterministic
        self.sample_rng = nnx.data(_stream(rngs, "sample"))
        self.dropout_rng = nnx.data(_stream(rngs, "dropout"))
        self.stats = AttentionStats({})
        self._set_linen_params(variables["params"], owner)

    # -- parameters ---------------------------------------------------------------------

    def _set_linen_params(self, params: Mapping[str, Any], owner: str) -> None:
        attrs = {name: _to_param(value) for name, value in params.items()}
        for name, value in attrs.items():
            if name in _OWN_ATTRIBUTES:
                raise ValueError(f"{owner}: a Linen parameter named {name!r} clashes with the face")
            setattr(self, name, nnx.data(value) if isinstance(value, dict) else value)

    def _param_names(self) -> list[str]:
        return [
            name
            for name, value in vars(self).items()
            if not name.startswith("_")
            and name not in _OWN_ATTRIBUTES
            and (isinstance(value, (dict, nnx.Param)))
        ]

    def _param_tree(self) -> dict[str, Any]:
        def values(tree: Any) -> Any:
            if isinstance(tree, nnx.Variable):
                return tree.get_value()
            return {k: values(v) for k, v in tree.items()}

        return {name: values(getattr(self, name)) for name in self._param_names()}

    def linen_params(self, *, boxed: bool = False) -> dict[str, Any]:
        """The parameters as the Linen module's ``variables["params"]``: plain arrays, or
        (``boxed=True``) with their logical axis names, as ``Module.init`` returns them."""
        if not boxed:
            return self._param_tree()

        def box(tree: Any) -> Any:
            if isinstance(tree, nnx.Variable):
                names = tree.get_metadata().get("out_sharding")
                value = tree.get_value()
                return nn.LogicallyPartitioned(value, tuple(names)) if names else value
            return {k: box(v) for k, v in tree.items()}

        return {name: box(getattr(self, name)) for name in self._param_names()}

    def load_linen_params(self, params: Mapping[str, Any]) -> None:
        """Set the parameters from a Linen ``params`` tree (boxed or not; a whole
        ``{"params": ...}`` variables dict too). The tree must be this layer's: a missing,
        extra or differently shaped entry is a ValueError naming it, and nothing is set."""
        if not isinstance(params, Mapping):
            raise TypeError(f"a Linen params tree is a mapping, got {type(params).__name__}")
        if set(params) == {"params"}:
            params = params["params"]
        given = _flat(nn.unbox(dict(params)))
        mine = _flat(self._param_tree())
        owner = type(self).__name__
        missing = sorted("/".join(p) for p in mine.keys() - given.keys())
        extra = sorted("/".join(p) for p in given.keys() - mine.keys())
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected {', '.join(extra)}")
            raise ValueError(f"Linen params do not match {owner}: {'; '.join(parts)}")
        for path, leaf in mine.items():
            if _shape(given[path]) != _shape(leaf):
                raise ValueError(
                    f"Linen params do not match {owner}: {'/'.join(path)} has shape "
                    f"{_shape(given[path])}, the layer's is {_shape(leaf)}"
                )
        for path, leaf in given.items():
            node: Any = getattr(self, path[0])
            for key in path[1:]:
                node = node[key]
            node.set_value(jax.numpy.asarray(leaf, node.get_value().dtype))

    # -- calling ------------------------------------------------------------------------

    def _keys(self, rngs: nnx.Rngs | None, deterministic: bool) -> dict[str, jax.Array]:
        streams: dict[str, Any] = {"sample": self.sample_rng, "dropout": self.dropout_rng}
        if rngs is not None:
            # Drawn from directly, as nnx.Dropout does with call-time rngs.
            if not isinstance(rngs, nnx.Rngs):
                raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
            streams = {name: _get(rngs, name) for name in _RNG_STREAMS}
        keys = {}
        for name, stream in streams.items():
            if stream is None or (name == "dropout" and deterministic):
                continue
            keys[name] = stream()
        return keys

    def _apply(
        self, *args: Any, rngs: nnx.Rngs | None, deterministic: bool | None, **kwargs: Any
    ) -> Any:
        deterministic = self.deterministic if deterministic is None else deterministic
        keys = self._keys(rngs, deterministic)
        try:
            out, updates = self.linen_module.apply(
                {"params": self._param_tree()},
                *args,
                rngs=keys,
                mutable=[STATS_COLLECTION],
                deterministic=deterministic,
                **kwargs,
            )
        except (flax.errors.InvalidRngError, ValueError) as err:
            # flax's own error, or a mechanism's Linen-worded one about a stream we did
            # not pass: reworded for NNX; any other error passes through unchanged.
            found = _MISSING_RNG.search(str(err))
            absent = [n for n in _RNG_STREAMS if n not in keys and f"'{n}'" in str(err)]
            if found:
                stream = found.group(1)
            elif absent:
                stream = absent[0]
            else:
                raise
            raise ValueError(
                f"{type(self).__name__} needs the rng stream {stream!r} for this call but its "
                f"rngs have none: build it with rngs=nnx.Rngs(0, {stream}=1) (or pass rngs=)"
            ) from None
        self.stats.set_value(_unwrap_sown(dict(updates.get(STATS_COLLECTION, {}))))
        return out


def logical_names(tree: Any) -> Any:
    """The logical axis names of each ``nnx.Param`` of ``tree`` (a module or its state), as
    ``nnx.get_partition_spec`` reads them: a tree of ``PartitionSpec`` of logical names."""
    state = nnx.state(tree, nnx.Param) if isinstance(tree, nnx.Module) else tree
    return nnx.get_partition_spec(state)


__all__ = ["AttentionStats", "LinenFace", "logical_names"]
