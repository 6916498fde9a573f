"""The trainer's 2-axis mesh ``("data", "heads")`` and its rule for sharding parameters.

Batches are split over ``data`` only (every device of a ``heads`` row sees the same
examples). Parameters, and the optimizer state that mirrors them, are replicated
except the per-head attention parameters, which are split over ``heads`` on their
head axis, so each device computes (and SBM samples graphs for) its own heads:

==========================================  =================  =========
parameter (module / name)                   shape              head axis
==========================================  =================  =========
``query`` / ``key`` / ``value`` ``kernel``  ``[dim, H, hd]``   1
``query`` / ``key`` / ``value`` ``bias``    ``[H, hd]``        0
``out`` ``kernel``                          ``[H, hd, dim]``   0
``clusters`` (SBM)                          ``[H, k, hd]``     0
``mlp_w1`` / ``mlp_w2`` (SBM, per head)     ``[H, hd, hd]``    0
``mlp_b1`` / ``mlp_b2`` (SBM, per head)     ``[H, hd]``        0
==========================================  =================  =========

The head axis is recognised by the parameter's name, its parent module's name and its
rank, so every mechanism built on the shared ``DenseGeneral`` projections
(``sbm_jax.attention._projections``: full, linear, performer, linformer, nystromformer,
...) gets the rule for free; anything else (embeddings, layer norms, the feed-forward
blocks, the ``out`` bias, SBM's shared MLP ``[hd, hd]``, Linformer's projections, ...)
is replicated, and so is a per-head parameter whose head axis is not a multiple of the
mesh's ``heads`` size. With ``heads`` of size 1 (or no ``heads`` axis) everything is
replicated: the 1-axis data-parallel layout.

The optimizer state gets the same sharding leaf by leaf: a leaf whose key path ends
with a parameter's full path and has that parameter's shape (optax's Adam ``mu`` and
``nu``) is sharded like the parameter; everything else (``step``, ``count``, ``rng``)
is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
HEADS_AXIS = "heads"

_PROJECTIONS = frozenset({"query", "key", "value"})
_PER_HEAD_3D = frozenset({"clusters", "mlp_w1", "mlp_w2"})  # [H, ., .], head axis 0
_PER_HEAD_2D = frozenset({"mlp_b1", "mlp_b2"})  # [H, hd], head axis 0


def make_data_heads_mesh(data: int, heads: int = 1) -> Mesh:
    """Mesh ``("data", "heads")`` of shape ``(data, heads)`` over the first devices."""
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


def head_axis(path: Sequence[str], shape: Sequence[int]) -> int | None:
    """The head axis of the parameter at ``path`` (module names then the parameter's
    name) with ``shape``, or None when it has no per-head axis (see the module's table)."""
    if not path:
        return None
    name = path[-1]
    parent = path[-2] if len(path) >= 2 else ""
    ndim = len(shape)
    if parent in _PROJECTIONS:
        if name == "kernel" and ndim == 3:
            return 1
        if name == "bias" and ndim == 2:
            return 0
        return None
    if parent == "out" and name == "kernel" and ndim == 3:
        return 0
    if name in _PER_HEAD_3D and ndim == 3:
        return 0
    if name in _PER_HEAD_2D and ndim == 2:
        return 0
    return None


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_names(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in path)


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", np.shape(leaf)))


def param_spec(path: Sequence[str], shape: Sequence[int], heads: int) -> P:
    """PartitionSpec of one parameter on a mesh whose ``heads`` axis has ``heads`` devices."""
    axis = head_axis(path, shape)
    if heads <= 1 or axis is None or shape[axis] % heads:
        return P()
    spec: list[str | None] = [None] * len(shape)
    spec[axis] = HEADS_AXIS
    return P(*spec)


def param_sharding(params: Any, mesh: Mesh | AbstractMesh) -> Any:
    """Pytree of ``NamedSharding`` (same structure as ``params``) by the module's rule."""
    heads = heads_axis_size(mesh)

    def one(path: Sequence[Any], leaf: Any) -> NamedSharding:
        return NamedSharding(mesh, param_spec(_path_names(path), _shape(leaf), heads))

    return jax.tree.map_with_path(one, params)


def tree_sharding(tree: Any, params: Any, mesh: Mesh | AbstractMesh) -> Any:
    """Shardings of any pytree holding ``params`` or mirrors of them (a train state, an
    optax state): a leaf whose key path ends with a parameter's full path and has its
    shape gets that parameter's sharding; every other leaf is replicated."""
    heads = heads_axis_size(mesh)
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], P]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names, shape = _path_names(path), _shape(leaf)
        by_path[names] = (shape, param_spec(names, shape, heads))
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

    return jax.tree.map_with_path(one, tree)


def state_sharding(state: Any, mesh: Mesh | AbstractMesh) -> Any:
    """Shardings of a train state (``.params``, ``.opt_state``, ``.step``, ``.rng``):
    the same pytree structure with a ``NamedSharding`` per leaf (``tree_sharding``)."""
    return tree_sharding(state, state.params, mesh)


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


def _mesh_int(mesh_cfg: Any, name: str, default: int) -> int:
    from sbm_jax.training.config_checks import ConfigError

    value = mesh_cfg.get(name, default)
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
    from sbm_jax.training.config_checks import ConfigError

    mesh_cfg = config.get("mesh") or {}
    data = _mesh_int(mesh_cfg, "data", -1)
    heads = _mesh_int(mesh_cfg, "heads", 1)
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
    return make_data_heads_mesh(data, heads)
