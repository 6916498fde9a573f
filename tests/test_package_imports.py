"""The package face: what ``import sbm_jax...`` loads, and the import graph has no cycle.

The ``sys.modules`` checks run in a fresh interpreter (this test process has long since
imported flax and every mechanism). The cycle check reads the sources (``ast``), so it sees
the imports inside functions too, which run only when the function is called.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sbm_jax

PACKAGE_DIR = Path(sbm_jax.__file__).parent
PUBLIC_NAMES = [
    "EdgeList",
    "SBMAttention",
    "dense_masked_attention",
    "edge_attention",
    "edge_softmax",
    "sample_sbm_graph",
    "straight_through",
]
# The array-level core: importing any of these must not load a mechanism nor flax.
LIGHT_MODULES = ["sbm_jax", "sbm_jax.graph", "sbm_jax.fastrg", "sbm_jax.edge_ops", "sbm_jax.ste"]


def _fresh_python(code: str) -> dict:
    """Run ``code`` in a new interpreter (this repo's sbm_jax first); return its JSON."""
    root = str(PACKAGE_DIR.parent)
    prog = f"import sys; sys.path.insert(0, {root!r})\n{code}"
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_loads_no_flax_and_public_names_load_on_first_use():
    # One interpreter (each costs seconds): if all of them together load neither flax nor
    # a mechanism, neither does any one of them.
    got = _fresh_python(
        f"import json, importlib\nfor m in {LIGHT_MODULES!r}: importlib.import_module(m)\n"
        "import sbm_jax\n"
        "loaded = [m for m in sys.modules\n"
        "    if m.split('.')[0] == 'flax' or m.startswith('sbm_jax.attention')]\n"
        "cls = sbm_jax.SBMAttention\n"
        "print(json.dumps({'file': sbm_jax.__file__, 'loaded': loaded,\n"
        "    'after': 'sbm_jax.attention.sbm' in sys.modules,\n"
        "    'qualname': cls.__module__ + '.' + cls.__qualname__, 'dir': dir(sbm_jax),\n"
        "    'all': sbm_jax.__all__, 'version': sbm_jax.__version__}))"
    )
    assert got["file"] == sbm_jax.__file__  # the subprocess tested this checkout
    assert got["loaded"] == []
    assert got["after"] is True
    assert got["qualname"] == "sbm_jax.attention.sbm.SBMAttention"
    assert sorted(got["all"]) == sorted(PUBLIC_NAMES)
    assert set(PUBLIC_NAMES) | {"__version__", "__all__"} <= set(got["dir"])
    assert got["version"] == "0.1.0"


def test_public_names_are_the_defining_objects():
    from sbm_jax.attention.sbm import SBMAttention
    from sbm_jax.edge_ops import dense_masked_attention, edge_attention, edge_softmax
    from sbm_jax.fastrg import sample_sbm_graph
    from sbm_jax.graph import EdgeList
    from sbm_jax.ste import straight_through

    expected = {
        "EdgeList": EdgeList,
        "SBMAttention": SBMAttention,
        "dense_masked_attention": dense_masked_attention,
        "edge_attention": edge_attention,
        "edge_softmax": edge_softmax,
        "sample_sbm_graph": sample_sbm_graph,
        "straight_through": straight_through,
    }
    for name, obj in expected.items():
        assert getattr(sbm_jax, name) is obj, name
    namespace: dict = {}
    exec("from sbm_jax import *", namespace)
    assert {n for n in namespace if not n.startswith("__")} == set(PUBLIC_NAMES)


def test_unknown_attribute_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_name"):
        sbm_jax.no_such_name  # noqa: B018
    assert not hasattr(sbm_jax, "no_such_name")


# --- EdgeList and SamplingPlan: plain pytree dataclasses, as flax.struct made them -------


def _flax_twin(cls: type) -> type:
    """The same fields as ``cls`` in a ``flax.struct.dataclass`` (what they were before)."""
    import dataclasses

    import flax.struct

    namespace: dict = {"__annotations__": {}}
    for f in dataclasses.fields(cls):
        namespace["__annotations__"][f.name] = f.type
        if f.metadata.get("static"):
            namespace[f.name] = flax.struct.field(pytree_node=False, default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f.name] = dataclasses.field(default_factory=f.default_factory)
    return flax.struct.dataclass(type(cls.__name__, (), namespace))


def _static(cls: type) -> set[str]:
    """Fields that are part of the tree structure (EdgeList's ``num_rows``/``num_cols``)."""
    import dataclasses

    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("static")}


@pytest.mark.parametrize("name", ["EdgeList", "SamplingPlan"])
def test_pytree_dataclasses_behave_as_flax_struct_did(name):
    import dataclasses

    import jax
    import numpy as np

    from sbm_jax import fastrg, graph

    cls = {"EdgeList": graph.EdgeList, "SamplingPlan": fastrg.SamplingPlan}[name]
    twin = _flax_twin(cls)
    static = _static(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in static]
    values = {n: np.full((i + 1,), float(i), np.float32) for i, n in enumerate(names)}
    values |= {n: 7 + i for i, n in enumerate(sorted(static))}  # hashable, static under jit
    ours, theirs = cls(**values), twin(**values)
    if static:  # a static field is part of the structure, not a leaf
        other = cls(**(values | {n: 0 for n in static}))
        assert jax.tree_util.tree_structure(ours) != jax.tree_util.tree_structure(other)
    # Every field is a child, in field order, with the same key paths.
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ours)[0]]
    twin_paths = jax.tree_util.tree_flatten_with_path(theirs)[0]
    assert paths == [jax.tree_util.keystr(p) for p, _ in twin_paths] == [f".{n}" for n in names]
    leaves, treedef = jax.tree_util.tree_flatten(ours)
    assert treedef.num_leaves == len(names)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert all(getattr(rebuilt, n) is values[n] for n in names)
    # Traced under jit and mapped by tree_map; frozen; replace makes a copy.
    doubled = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: 2 * x, t))(ours)
    assert isinstance(doubled, cls)
    np.testing.assert_array_equal(getattr(doubled, names[-1]), 2 * values[names[-1]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(ours, names[0], None)
    swapped = ours.replace(**{names[0]: values[names[1]]})
    assert getattr(swapped, names[0]) is values[names[1]]
    assert getattr(ours, names[0]) is values[names[0]]
    # The defaults (EdgeList's counters) are those of the flax.struct class.
    required = {
        f.name: values[f.name]
        for f in dataclasses.fields(cls)
        if f.default_factory is dataclasses.MISSING and f.name not in static
    }
    a, b = cls(**required), twin(**required)
    for n in static:
        assert getattr(a, n) is None and getattr(b, n) is None
    for n in names:
        np.testing.assert_array_equal(getattr(a, n), getattr(b, n))
        assert np.asarray(getattr(a, n)).dtype == np.asarray(getattr(b, n)).dtype


# --- the import graph between sbm_jax modules -------------------------------------------

# Edges left out of the cycle check, each with why (the test below insists each still
# exists). None today: attention.registry no longer imports its own package.
ALLOWED_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST):
    """Every Import/ImportFrom node that can run (anywhere, functions included), skipping
    the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module of the package -> the package's modules it names in an import that can run.

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.
    The implicit import of a module's parent packages is left out: a package that imports
    its own submodules is not a cycle Python trips on.
    """
    root = package_dir.parent
    files = {_module_name(p, root): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                parts = name.split(".")
                base = parts[: len(parts) - node.level + is_pkg]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in files else module)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_and_none():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "a.py": "import os\nfrom pkg import b\nfrom pkg.sub import helper\n",
        "b.py": "def f():\n    from .sub.c import g\n    import pkg.a as a\n",
        "sub/__init__.py": "from . import c\nhelper = 1\n",
        "sub/c.py": "from .. import b\nfrom ..a import x\n",
    }
    for rel, text in sources.items():
        (pkg / rel).write_text(text)
    assert import_graph(pkg) == {
        "pkg": set(),  # a TYPE_CHECKING import never runs
        "pkg.a": {"pkg.b", "pkg.sub"},  # ``helper`` is a name of pkg.sub, not a module
        "pkg.b": {"pkg.sub.c", "pkg.a"},  # imports inside a function count
        "pkg.sub": {"pkg.sub.c"},
        "pkg.sub.c": {"pkg.b", "pkg.a"},
    }
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_sbm_jax_import_graph_has_no_cycle():
    graph = import_graph(PACKAGE_DIR)
    for (src, dst), why in ALLOWED_EDGES.items():
        assert dst in graph[src], f"allowed edge {src} -> {dst} ({why}) is gone: drop it"
        graph[src].discard(dst)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_nnx_face_loads_no_mechanism_until_one_is_used():
    got = _fresh_python(
        "import json\nfrom sbm_jax import nnx\n"
        "heavy = ('sbm_jax.attention', 'sbm_jax.models')\n"
        "loaded = [m for m in sys.modules if m.startswith(heavy)]\n"
        "cls = nnx.SBMAttention\n"
        "print(json.dumps({'loaded': loaded, 'after': 'sbm_jax.attention.sbm' in sys.modules,\n"
        "    'name': cls.__name__}))"
    )
    assert got == {"loaded": [], "after": True, "name": "SBMAttention"}


def test_nnx_face_is_a_lazy_attribute_of_the_package():
    # ``import sbm_jax`` alone, then the attribute: nothing heavy until a class is used.
    got = _fresh_python(
        "import json\nimport sbm_jax\n"
        "heavy = lambda: sorted(m for m in sys.modules if m.split('.')[0] == 'flax'\n"
        "    or m.startswith(('sbm_jax.attention', 'sbm_jax.models', 'sbm_jax.nnx')))\n"
        "before = heavy()\n"
        "listed = 'nnx' in dir(sbm_jax)\n"
        "face = sbm_jax.nnx\n"
        "on_access = heavy()\n"
        "cls = sbm_jax.nnx.SBMAttention\n"
        "import sbm_jax.nnx as direct\n"
        "from sbm_jax import *\n"
        "print(json.dumps({'before': before, 'listed': listed, 'on_access': on_access,\n"
        "    'module': face.__name__, 'same': face is direct and face is sbm_jax.nnx,\n"
        "    'cls': cls.__module__ + '.' + cls.__name__, 'star': 'nnx' in globals(),\n"
        "    'flax_after': 'flax.nnx' in sys.modules,\n"
        "    'sbm_after': 'sbm_jax.attention.sbm' in sys.modules}))"
    )
    assert got["before"] == []
    assert got["listed"] is True
    assert got["on_access"] == ["sbm_jax.nnx"]  # the face's own package, no flax yet
    assert got["module"] == "sbm_jax.nnx" and got["same"] is True
    assert got["cls"] == "sbm_jax.nnx.SBMAttention"
    assert got["flax_after"] is True and got["sbm_after"] is True
    # Not in __all__: a star import must not shadow ``from flax import nnx``.
    assert got["star"] is False
