"""The parameter-sharding rule (sbm_jax.training.sharding) on abstract meshes, and the
start-up errors of the trainer's ("data", "heads") mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from sbm_jax.attention.full import FullAttention
from sbm_jax.attention.sbm import SBMAttention
from sbm_jax.training.config_checks import ConfigError
from sbm_jax.training.sharding import (
    mesh_from_config,
    param_sharding,
    state_sharding,
    tree_sharding,
)
from sbm_jax.training.state import TrainState

H, HD, DIM, K = 4, 3, 12, 5


def _mesh(heads: int) -> AbstractMesh:
    return AbstractMesh((1, heads), ("data", "heads"))


def _specs(shardings) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    return {jax.tree_util.keystr(path): s.spec for path, s in flat}


def _tiny_params() -> dict:
    """Hand-written tree with the attention modules' names and shapes."""
    z = np.zeros
    proj = lambda: {"kernel": z((DIM, H, HD)), "bias": z((H, HD))}  # noqa: E731
    return {
        "embed": {"embedding": z((10, DIM))},
        "block_0": {
            "attention": {
                "query": proj(),
                "key": proj(),
                "value": proj(),
                "out": {"kernel": z((H, HD, DIM)), "bias": z((DIM,))},
                "clusters": z((H, K, HD)),
                "mlp_w1": z((H, HD, HD)),
                "mlp_b1": z((H, HD)),
                "mlp_w2": z((H, HD, HD)),
                "mlp_b2": z((H, HD)),
            },
            "mlp": {"out": {"kernel": z((DIM, DIM)), "bias": z((DIM,))}},
            "norm": {"scale": z((DIM,)), "bias": z((DIM,))},
        },
        "shared": {"mlp_w1": z((HD, HD)), "mlp_b1": z((HD,))},  # SBM's shared_mlp shapes
    }


EXPECTED = {
    "['embed']['embedding']": P(),
    "['block_0']['attention']['query']['kernel']": P(None, "heads", None),
    "['block_0']['attention']['query']['bias']": P("heads", None),
    "['block_0']['attention']['key']['kernel']": P(None, "heads", None),
    "['block_0']['attention']['key']['bias']": P("heads", None),
    "['block_0']['attention']['value']['kernel']": P(None, "heads", None),
    "['block_0']['attention']['value']['bias']": P("heads", None),
    "['block_0']['attention']['out']['kernel']": P("heads", None, None),
    "['block_0']['attention']['out']['bias']": P(),
    "['block_0']['attention']['clusters']": P("heads", None, None),
    "['block_0']['attention']['mlp_w1']": P("heads", None, None),
    "['block_0']['attention']['mlp_b1']": P("heads", None),
    "['block_0']['attention']['mlp_w2']": P("heads", None, None),
    "['block_0']['attention']['mlp_b2']": P("heads", None),
    "['block_0']['mlp']['out']['kernel']": P(),
    "['block_0']['mlp']['out']['bias']": P(),
    "['block_0']['norm']['scale']": P(),
    "['block_0']['norm']['bias']": P(),
    "['shared']['mlp_w1']": P(),
    "['shared']['mlp_b1']": P(),
}


def test_param_sharding_rule_on_named_tree():
    assert _specs(param_sharding(_tiny_params(), _mesh(2))) == EXPECTED
    assert _specs(param_sharding(_tiny_params(), _mesh(4))) == EXPECTED


def test_param_sharding_replicates_without_a_heads_split():
    # heads=1, no heads axis, or H=4 not divisible by 3: everything replicated
    for mesh in (_mesh(1), AbstractMesh((2,), ("data",)), _mesh(3)):
        specs = _specs(param_sharding(_tiny_params(), mesh))
        assert set(specs.values()) == {P()}, mesh


@pytest.mark.parametrize("module", ["sbm", "full"])
def test_param_sharding_matches_real_attention_modules(module):
    """The rule finds the head axis of the modules' own parameters (names and shapes)."""
    x = jnp.zeros((1, 6, DIM))
    if module == "sbm":
        layer = SBMAttention(num_heads=H, head_dim=HD, num_clusters=K, impl="dense")
    else:
        layer = FullAttention(num_heads=H, head_dim=HD, out_dim=DIM)
    key = jax.random.PRNGKey(0)
    params = jax.eval_shape(
        lambda: layer.init(
            {"params": key, "sample": key, "dropout": key}, x, jnp.ones((1, 6)), deterministic=True
        ),
    )["params"]
    specs = _specs(param_sharding(params, _mesh(2)))
    expected = {
        "['query']['kernel']": P(None, "heads", None),
        "['query']['bias']": P("heads", None),
        "['key']['kernel']": P(None, "heads", None),
        "['key']['bias']": P("heads", None),
        "['value']['kernel']": P(None, "heads", None),
        "['value']['bias']": P("heads", None),
        "['out']['kernel']": P("heads", None, None),
        "['out']['bias']": P(),
    }
    if module == "sbm":
        expected.update(
            {
                "['clusters']": P("heads", None, None),
                "['mlp_w1']": P("heads", None, None),
                "['mlp_w2']": P("heads", None, None),
                "['mlp_b1']": P("heads", None),
                "['mlp_b2']": P("heads", None),
            }
        )
    assert specs == expected
    # The head axis the rule picked really has the module's num_heads entries.
    flat = dict(
        (jax.tree_util.keystr(p), leaf.shape)
        for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    )
    for name, spec in expected.items():
        if spec != P():
            assert flat[name][list(spec).index("heads")] == H, name


def test_optimizer_state_mirrors_params_and_scalars_are_replicated():
    params = _tiny_params()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = TrainState.create(
        apply_fn=lambda *a, **k: None, params=params, tx=tx, rng=jax.random.PRNGKey(0)
    )
    shard = state_sharding(state, _mesh(2))
    assert jax.tree.structure(shard) == jax.tree.structure(state)
    assert _specs(shard.params) == EXPECTED
    adam = shard.opt_state[1][0]  # chain -> adamw -> ScaleByAdamState(count, mu, nu)
    assert _specs(adam.mu) == EXPECTED and _specs(adam.nu) == EXPECTED
    assert adam.count.spec == P()
    assert shard.step.spec == P() and shard.rng.spec == P()
    # a leaf whose path ends like a parameter's but has another shape is replicated
    other = {"x": {"query": {"kernel": np.zeros((DIM, H + 1, HD))}}}
    mirrored = tree_sharding({"x": {"query": {"kernel": np.zeros((DIM, H, HD))}}}, other, _mesh(2))
    assert mirrored["x"]["query"]["kernel"].spec == P()


def _config(**mesh) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict({"num_heads": 6})
    config.mesh = ml_collections.ConfigDict(mesh)
    return config


def test_mesh_from_config_defaults_to_data_parallel():
    mesh = mesh_from_config(_config(data=-1))  # no mesh.heads: 1
    assert mesh.axis_names == ("data", "heads")
    assert dict(mesh.shape) == {"data": jax.device_count(), "heads": 1}


@pytest.mark.parametrize(
    "mesh, match",
    [
        ({"data": -1, "heads": 4}, r"mesh.heads=4 must divide model.num_heads=6"),
        ({"data": -1, "heads": 3}, r"mesh.heads=3 does not divide the 8 devices"),
        ({"data": 4, "heads": 3}, r"mesh.data=4 x mesh.heads=3 = 12 devices"),
        ({"data": 0, "heads": 2}, r"mesh.data=0 must be -1 or >= 1"),
        ({"data": 2, "heads": 0}, r"mesh.heads=0 must be between 1 and 8"),
        ({"data": 1, "heads": 16}, r"mesh.heads=16 must be between 1 and 8"),
        ({"data": 1, "heads": 2.0}, r"mesh.heads=2.0 must be an integer"),
    ],
)
def test_mesh_from_config_errors_name_the_fields(monkeypatch, mesh, match):
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    with pytest.raises(ConfigError, match=match):
        mesh_from_config(_config(**mesh))


def test_mesh_heads_requires_model_num_heads(monkeypatch):
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    config = _config(data=2, heads=2)
    del config.model["num_heads"]
    with pytest.raises(ConfigError, match="model.num_heads"):
        mesh_from_config(config)
