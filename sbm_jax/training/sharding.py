"""The trainer's 2-axis mesh ``("data", "heads")`` and its rule for sharding parameters.

Batches are split over ``data`` only (every device of a ``heads`` row sees the same
examples). Parameters, and the optimizer state that mirrors them, are replicated
except the per-head attention parameters, which are split over ``heads`` on their
head axis, so each device computes (and SBM samples graphs for) its own heads.

Where the head axis comes from: every attention mechanism declares logical axis names
on its parameters (flax partitioning metadata, ``nn.with_logical_partitioning``; the
shared projections are ``sbm_jax.attention._projections.head_dense`` / ``out_dense``),
with ``heads`` on each per-head axis. ``model.init`` returns the parameters boxed with
those names; ``logical_axes`` reads them (``create_train_state`` keeps them on the train
state as ``TrainState.param_axes``, then unboxes the parameters to plain arrays) and
``LOGICAL_AXIS_RULES`` maps them to the mesh (``nn.logical_to_mesh_axes``):

====================  ===============  ===============================================
logical name          mesh axis        examples (shape, names)
====================  ===============  ===============================================
``heads``             ``heads``        ``query`` / ``key`` / ``value`` / Reformer's
                                       ``query_key`` ``kernel`` ``[dim, H, hd]``
                                       ``(embed, heads, kv)``, their ``bias`` ``[H, hd]``;
                                       ``out`` ``kernel`` ``[H, hd, dim]``; SBM's
                                       ``clusters`` ``[H, k, hd]`` and per-head
                                       ``mlp_*``; TSA's per-head TT cores ``[H, ...]``;
                                       Nystromformer's ``value_conv`` ``[s, 1, 1, H]``
anything else         replicated       ``embed``, ``kv``, ``mlp``, ``clusters``,
                                       ``length``, ... (the ``out`` bias, SBM's shared
                                       MLP, Linformer's projections)
====================  ===============  ===============================================

A parameter without names (embeddings, layer norms, the feed-forward blocks, the
classifier on top) is replicated, and so is a per-head parameter whose head axis is not a
multiple of the mesh's ``heads`` size. With ``heads`` of size 1 (or no ``heads`` axis)
everything is replicated: the 1-axis data-parallel layout.

The optimizer state gets the same sharding leaf by leaf: a leaf whose key path ends
with a parameter's full path and has that parameter's shape (optax's Adam ``mu`` and
``nu``) is sharded like the parameter; everything else (``step``, ``count``, ``rng``)
is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
HEADS_AXIS = "heads"

# Logical axis name -> mesh axis; every name without a rule is replicated.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (("heads", HEADS_AXIS),)

# (parameter path, its logical axis names) for every named parameter: hashable, so it
# can ride on a train state as static metadata.
ParamAxes = tuple[tuple[tuple[str, ...], tuple[str | None, ...]], ...]


def make_mesh(data: int | None = None, heads: int = 1) -> Mesh:
    """Mesh ``("data", "heads")`` of shape ``(data, heads)`` over the first devices
    (``data`` None: all devices / ``heads``); ``make_mesh(n)`` is the data-parallel
    layout over ``n`` devices. The trainer's comes from the config (``mesh_from_config``)."""
    if data is None:
        data = jax.device_count() // heads
    if data < 1 or heads < 1:
        raise ValueError(f"mesh shape ({data}, {heads}) must be positive")
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((data, heads), (DATA_AXIS, HEADS_AXIS), axis_types=(auto, auto))


def data_axis_size(mesh: Mesh | AbstractMesh) -> int:
    """Devices the batch axis is split over (the ``data`` axis' size)."""
    return int(dict(mesh.shape).get(DATA_AXIS, 1))


def heads_axis_size(mesh: Mesh | AbstractMesh) -> int:
    """Size of the ``heads`` axis (1 when the mesh has none)."""
    return int(dict(mesh.shape).get(HEADS_AXIS, 1))


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_names(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in path)


def _shape(leaf: Any) -> tuple[int, ...]:
    if _is_box(leaf):
        leaf = leaf.unbox()
    return tuple(getattr(leaf, "shape", np.shape(leaf)))


def logical_axes(params: Any) -> ParamAxes:
    """The logical axis names of the parameters of ``params`` that carry them.

    ``params``: parameters boxed by ``nn.with_logical_partitioning`` (what ``model.init``
    returns, or ``jax.eval_shape`` of it). Returns ``((path, names), ...)``, ``path`` the
    parameter's key names (as in the unboxed tree), ``names`` one per axis; plain leaves
    have none and are left out.
    """
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
    return tuple(
        (_path_names(path), tuple(leaf.names))
        for path, leaf in flat
        if isinstance(leaf, nn.Partitioned)
    )


def unbox(params: Any) -> Any:
    """``params`` with every logical-axes box replaced by its plain array."""
    return meta.unbox(params)


def param_spec(
    names: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh_shape: Mapping[str, int],
    rules: Sequence[tuple[str, str | None]] = LOGICAL_AXIS_RULES,
) -> P:
    """PartitionSpec of one parameter with logical axis ``names`` (None: it has none)
    and ``shape`` on a mesh of ``mesh_shape`` (axis name -> size), by ``rules``.

    A mesh axis the mesh lacks or of size 1 splits nothing; an axis whose size is not a
    multiple of its mesh axis' size replicates the whole parameter.
    """
    if names is None:
        return P()
    if len(names) != len(shape):
        raise ValueError(f"logical axis names {tuple(names)} do not match shape {tuple(shape)}")
    spec: list[Any] = []
    for size, axis in zip(shape, nn.logical_to_mesh_axes(tuple(names), list(rules)), strict=True):  # type: ignore[arg-type]
        axes = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        devices = int(np.prod([int(mesh_shape.get(a, 1)) for a in axes]))
        if devices <= 1:
            spec.append(None)
        elif size % devices:
            return P()
        else:
            spec.append(axis)
    if all(a is None for a in spec):
        return P()
    return P(*spec)


def param_sharding(params: Any, mesh: Mesh | AbstractMesh, axes: ParamAxes | None = None) -> Any:
    """Pytree of ``NamedSharding`` (the structure of the unboxed ``params``) by the
    module's rule.

    ``axes``: the parameters' logical axis names (``logical_axes``); None reads them from
    the boxes in ``params`` (``model.init``'s output or its ``jax.eval_shape``).
    """
    by_path = dict(logical_axes(params) if axes is None else axes)
    mesh_shape = dict(mesh.shape)

    def one(path: Sequence[Any], leaf: Any) -> NamedSharding:
        names = by_path.get(_path_names(path))
        return NamedSharding(mesh, param_spec(names, _shape(leaf), mesh_shape))

    return jax.tree.map_with_path(one, params, is_leaf=_is_box)


def tree_sharding(
    tree: Any, params: Any, mesh: Mesh | AbstractMesh, axes: ParamAxes | None = None
) -> Any:
    """Shardings of any pytree holding ``params`` or mirrors of them (a train state, an
    optax state): a leaf whose key path ends with a parameter's full path and has its
    shape gets that parameter's sharding; every other leaf is replicated. ``axes`` as in
    ``param_sharding``."""
    by_names = dict(logical_axes(params) if axes is None else axes)
    mesh_shape = dict(mesh.shape)
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], P]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]:
        names, shape = _path_names(path), _shape(leaf)
        by_path[names] = (shape, param_spec(by_names.get(names), shape, mesh_shape))
    lengths = sorted({len(k) for k in by_path}, reverse=True)
    replicated = NamedSharding(mesh, P())

    def one(path: Sequence[Any], leaf: Any) -> NamedSharding:
        names, shape = _path_names(path), _shape(leaf)
        for n in lengths:
            if 0 < n <= len(names):
                hit = by_path.get(names[len(names) - n :])
                if hit is not None and hit[0] == shape:
                    return NamedSharding(mesh, hit[1])
        return replicated

    return jax.tree.map_with_path(one, tree, is_leaf=_is_box)


def state_sharding(state: Any, mesh: Mesh | AbstractMesh) -> Any:
    """Shardings of a train state (``.params``, ``.opt_state``, ``.step``, ``.rng``):
    the same pytree structure with a ``NamedSharding`` per leaf (``tree_sharding``),
    the parameters' logical axis names from ``state.param_axes`` (none: replicated)."""
    return tree_sharding(state, state.params, mesh, getattr(state, "param_axes", None) or ())


class StateShardedJit:
    """``jax.jit`` of ``fun(state, *args)`` whose state goes in (and out) with
    ``state_sharding(state, mesh)``.

    The sharding tree depends on the state's structure and shapes, which are known
    only at the first call, so one ``jax.jit`` is built per distinct state layout (a
    handful at most: a fresh and a resumed state of one run share it).

    Args:
      fun: the step.
      mesh: the mesh.
      in_shardings: ``state shardings -> in_shardings`` (a tuple, one per argument).
      out_shardings: ``state shardings -> out_shardings``.
      donate_argnums: as ``jax.jit``.
    """

    _MAX_LAYOUTS = 8

    def __init__(
        self,
        fun: Callable[..., Any],
        mesh: Mesh,
        in_shardings: Callable[[Any], tuple[Any, ...]],
        out_shardings: Callable[[Any], Any],
        donate_argnums: int | tuple[int, ...] = (),
    ) -> None:
        self.fun = fun
        self.mesh = mesh
        self._in = in_shardings
        self._out = out_shardings
        self._donate = donate_argnums
        self._compiled: list[tuple[Any, Any]] = []

    def jitted(self, state: Any) -> Any:
        """The ``jax.jit`` object used for states laid out like ``state``."""
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple(_shape(x) for x in leaves))
        for k, fn in self._compiled:
            if k == key:
                return fn
        shardings = state_sharding(state, self.mesh)
        fn = jax.jit(
            self.fun,
            in_shardings=self._in(shardings),
            out_shardings=self._out(shardings),
            donate_argnums=self._donate,
        )
        self._compiled = [*self._compiled[-(self._MAX_LAYOUTS - 1) :], (key, fn)]
        return fn

    def __call__(self, state: Any, *args: Any) -> Any:
        return self.jitted(state)(state, *args)


def _mesh_int(config: Any, name: str) -> int:
    from sbm_jax.config_defaults import field
    from sbm_jax.training.errors import ConfigError

    value = field(config, f"mesh.{name}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"config.mesh.{name}={value!r} must be an integer")
    return int(value)


def mesh_from_config(config: Any) -> Mesh:
    """Mesh ``("data", "heads")`` of shape ``(mesh.data, mesh.heads)``.

    ``mesh.heads`` (default 1) devices split the attention heads; ``mesh.data`` (default
    -1: all devices / ``mesh.heads``) split the batch; the mesh takes the first
    ``data * heads`` devices. With ``heads = 1`` this is the data-parallel layout.

    Raises:
      ConfigError naming ``mesh.heads``, ``mesh.data`` or ``model.num_heads``: a size
      below 1, more devices than there are, ``mesh.data=-1`` with a ``mesh.heads`` that
      does not divide the device count, or a ``mesh.heads`` that does not divide
      ``model.num_heads``.
    """
    from sbm_jax.training.errors import ConfigError

    data = _mesh_int(config, "data")
    heads = _mesh_int(config, "heads")
    available = jax.device_count()
    if not 1 <= heads <= available:
        raise ConfigError(f"config.mesh.heads={heads} must be between 1 and {available} (devices)")
    if data == -1:
        if available % heads:
            raise ConfigError(
                f"config.mesh.heads={heads} does not divide the {available} devices (mesh.data=-1 "
                "uses all of them); set mesh.data explicitly or change mesh.heads"
            )
        data = available // heads
    if data < 1:
        raise ConfigError(f"config.mesh.data={data} must be -1 or >= 1")
    if data * heads > available:
        raise ConfigError(
            f"config.mesh.data={data} x mesh.heads={heads} = {data * heads} devices, more than "
            f"the {available} available"
        )
    if heads > 1:
        model = config.get("model") or {}
        num_heads = model.get("num_heads")
        if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
            raise ConfigError(
                f"config.model.num_heads={num_heads!r} must be an integer when mesh.heads={heads}"
            )
        if int(num_heads) % heads:
            raise ConfigError(
                f"config.mesh.heads={heads} must divide model.num_heads={num_heads} (each device "
                "holds the same number of heads)"
            )
    return make_mesh(data, heads)
