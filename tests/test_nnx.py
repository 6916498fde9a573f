"""The NNX face (``sbm_jax.nnx``): same parameters, outputs, gradients and stats as the
Linen modules it wraps, on shared weights and keys, eagerly, under ``nnx.jit`` and over
stacked layers under ``nnx.vmap`` + ``nnx.scan``; checkpoints both ways; bad input.

The reference of each comparison is the Linen module applied by hand (``Module.apply``
with the same params and rng keys); the Linen modules themselves are checked against
dense references in their own tests.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sbm_jax import nnx as sbm_nnx
from sbm_jax.attention import STATS_COLLECTION, available, build_attention
from sbm_jax.models.encoder import Encoder
from sbm_jax.training.sharding import LOGICAL_AXIS_RULES, param_spec
from tests.test_mechanism_registry import PARAM_CASES

B, L, D, H, HD = 2, 12, 8, 2, 4
SBM_OPTIONS = {"num_clusters": 3}


def _inputs(seed: int = 0):
    x = jax.random.normal(jax.random.key(seed), (B, L, D))
    mask = jnp.arange(L)[None, :] < jnp.array([[L], [L - 3]])
    return x, mask


def _next_key(stream: nnx.RngStream) -> jax.Array:
    """The key ``stream`` hands out on its next call (``RngStream.__call__``)."""
    return jax.random.fold_in(stream.key[...], stream.count[...])


def _sbm(**kwargs) -> sbm_nnx.SBMAttention:
    return sbm_nnx.SBMAttention(H, HD, D, rngs=nnx.Rngs(0, sample=1), **SBM_OPTIONS, **kwargs)


def _linen_sbm():
    return build_attention("sbm", options=SBM_OPTIONS, num_heads=H, head_dim=HD, out_dim=D)


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_contract_example_samples_from_the_sample_stream_and_exposes_stats():
    x, mask = _inputs()
    layer = _sbm()
    key = _next_key(layer.sample_rng)
    y = layer(x, mask)
    assert y.shape == (B, L, D)
    density = layer.stats["density"]
    assert density.shape == (B, H)
    assert {"overflow", "path", "edges"} <= set(layer.stats.get_value())
    # The same sample key in the Linen module gives the same output and stats.
    want, state = _linen_sbm().apply(
        {"params": layer.linen_params()},
        x,
        mask,
        rngs={"sample": key},
        mutable=[STATS_COLLECTION],
        deterministic=False,  # the NNX face's default, as nnx.Dropout's: training
    )
    _close(y, want)
    _close(density, state[STATS_COLLECTION]["density"][0])
    # The stream moved on: a second call samples a new graph.
    assert not np.allclose(np.asarray(layer(x, mask)), np.asarray(y))


def test_outputs_and_gradients_equal_linen_under_nnx_jit():
    x, mask = _inputs()
    layer = _sbm()
    params = layer.linen_params()
    key = _next_key(layer.sample_rng)

    def linen_loss(p):
        y = _linen_sbm().apply({"params": p}, x, mask, rngs={"sample": key}, deterministic=False)
        return jnp.sum(jnp.where(mask[..., None], y, 0.0) ** 2)

    @nnx.jit
    def nnx_loss_and_grad(layer):
        def loss(layer):
            y = layer(x, mask)
            return jnp.sum(jnp.where(mask[..., None], y, 0.0) ** 2)

        return nnx.value_and_grad(loss)(layer)

    got_loss, got_grad = nnx_loss_and_grad(layer)
    want_loss, want_grad = jax.value_and_grad(linen_loss)(params)
    _close(got_loss, want_loss, 1e-4)
    got = nnx.to_pure_dict(got_grad)
    assert jax.tree.structure(got) == jax.tree.structure(want_grad)
    jax.tree.map(lambda a, b: _close(a, b, 1e-4), got, want_grad)
    assert layer.stats["density"].shape == (B, H)  # the jitted call wrote them back


@pytest.mark.parametrize("name, options", [c for c in PARAM_CASES if c[0] != "sbm"][::1])
def test_every_mechanism_matches_its_linen_module(name, options):
    x, mask = _inputs()
    rngs = nnx.Rngs(0, sample=1, dropout=2)
    layer = sbm_nnx.build_attention(
        name, num_heads=H, head_dim=HD, in_features=D, rngs=rngs, options=options
    )
    assert type(layer).__name__ == type(layer.linen_module).__name__
    linen = build_attention(name, options=options, num_heads=H, head_dim=HD, out_dim=D)
    # The parameter tree is the Linen init's, leaf for leaf.
    boxed = linen.init(
        {"params": jax.random.key(3), "sample": jax.random.key(4)}, x, mask, deterministic=True
    )["params"]
    assert jax.tree.map(jnp.shape, nn.unbox(boxed)) == jax.tree.map(jnp.shape, layer.linen_params())
    layer.load_linen_params(boxed)
    keys = {"sample": _next_key(layer.sample_rng)}
    y = layer(x, mask, deterministic=True)
    want = linen.apply({"params": boxed}, x, mask, deterministic=True, rngs=keys)
    _close(y, want, 1e-4)


def test_checkpoints_load_both_ways_and_keep_the_logical_axis_names():
    x, mask = _inputs()
    linen = _linen_sbm()
    call_rngs = lambda: nnx.Rngs(sample=7)  # noqa: E731
    key = _next_key(call_rngs().sample)
    boxed = linen.init({"params": jax.random.key(5), "sample": key}, x, mask)["params"]
    # Linen -> NNX: the same params give the Linen output.
    layer = _sbm()
    layer.load_linen_params({"params": boxed})
    want = linen.apply({"params": boxed}, x, mask, rngs={"sample": key})
    _close(layer(x, mask, deterministic=True, rngs=call_rngs()), want)
    # NNX -> Linen: the boxed tree equals the Linen init's, names included.
    trained = _sbm()
    back = trained.linen_params(boxed=True)
    assert jax.tree.structure(back) == jax.tree.structure(boxed)
    names = lambda t: [  # noqa: E731
        b.names for b in jax.tree.leaves(t, is_leaf=lambda v: isinstance(v, nn.Partitioned))
    ]
    assert names(back) == names(boxed)
    y = linen.apply({"params": back}, x, mask, rngs={"sample": key})
    _close(y, trained(x, mask, deterministic=True, rngs=call_rngs()))


def test_partition_specs_shard_heads_as_the_linen_trainer():
    layer = _sbm()
    mesh_shape = {"data": 1, "heads": H}
    boxed = layer.linen_params(boxed=True)
    flat_boxed = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.Partitioned))
    want = [param_spec(b.names, b.value.shape, mesh_shape) for b in flat_boxed]
    # NNX's own reading of the names, mapped by the trainer's rules (names without a rule
    # replicate, as in Linen): flax's documented NNX sharding recipe.
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    leaves = jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, nnx.Variable))
    got = [nn.logical_to_mesh_axes(tuple(s.get_value()), LOGICAL_AXIS_RULES) for s in leaves]

    def canonical(spec):
        return tuple(spec) if any(a is not None for a in spec) else ()

    assert [canonical(s) for s in got] == [canonical(w) for w in want]
    assert (None, "heads", None) in [canonical(s) for s in got]


def test_stacked_layers_under_vmap_and_scan_equal_linen_layer_by_layer():
    x, mask = _inputs()
    depth = 2

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return sbm_nnx.SBMAttention(H, HD, D, rngs=rngs, **SBM_OPTIONS)

    layers = create(nnx.Rngs(0, sample=1))
    params = layers.linen_params()
    keys = [
        jax.random.fold_in(layers.sample_rng.key[...][i], layers.sample_rng.count[...][i])
        for i in range(depth)
    ]

    @nnx.jit
    def forward(layers, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(h, layer):
            return h + layer(h, mask)

        return step(x, layers)

    got = forward(layers, x)
    h = x
    for i in range(depth):
        p = jax.tree.map(lambda a: a[i], params)  # noqa: B023
        h = h + _linen_sbm().apply(
            {"params": p}, h, mask, rngs={"sample": keys[i]}, deterministic=False
        )
    _close(got, h, 1e-4)
    assert layers.stats["density"].shape == (depth, B, H)


def test_encoder_face_matches_linen_and_trains_with_nnx_optimizer():
    fields = dict(
        vocab_size=11, max_len=L, emb_dim=D, num_layers=1, num_heads=H, head_dim=HD,
        mlp_dim=16, attention="sbm", attention_options=SBM_OPTIONS,
    )  # fmt: skip
    model = sbm_nnx.Encoder(**fields, rngs=nnx.Rngs(0, sample=1))
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, 11)
    _, mask = _inputs()
    key = _next_key(model.sample_rng)
    got = model(tokens, mask, deterministic=True)
    want = Encoder(**fields).apply(
        {"params": model.linen_params()}, tokens, mask, deterministic=True, rngs={"sample": key}
    )
    jax.tree.map(lambda a, b: _close(a, b, 1e-4), got, want)
    assert model.stats["block_0"]["attention"]["density"].shape == (B, H)

    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        def loss(model):
            return jnp.mean(model(tokens, mask)[2] ** 2)

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    before = model.linen_params()
    losses = [float(train_step(model, optimizer)) for _ in range(3)]
    assert np.all(np.isfinite(losses))
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), before, model.linen_params())
    assert all(jax.tree.leaves(changed))


def test_registry_and_face_agree():
    assert sorted(sbm_nnx.MECHANISMS.values()) == available()
    for cls_name, name in sbm_nnx.MECHANISMS.items():
        assert getattr(sbm_nnx, cls_name) is sbm_nnx.attention_class(name)
        assert getattr(sbm_nnx, cls_name).__name__ == cls_name


def test_bad_input_is_one_clear_line():
    x, mask = _inputs()
    no_sample = sbm_nnx.SBMAttention(H, HD, D, rngs=nnx.Rngs(params=0), **SBM_OPTIONS)
    with pytest.raises(ValueError, match=r"needs the rng stream 'sample'.*nnx.Rngs\(0, sample=1\)"):
        no_sample(x, mask)
    with pytest.raises(ValueError, match="no 'params'"):
        sbm_nnx.SBMAttention(H, HD, D, rngs=nnx.Rngs(sample=1), **SBM_OPTIONS)
    layer = _sbm()
    params = layer.linen_params()
    with pytest.raises(ValueError, match="missing clusters"):
        layer.load_linen_params({k: v for k, v in params.items() if k != "clusters"})
    with pytest.raises(ValueError, match=r"query/kernel has shape \(8, 2, 5\)"):
        bad = dict(params, query=dict(params["query"], kernel=jnp.zeros((D, H, HD + 1))))
        layer.load_linen_params(bad)
    with pytest.raises(ValueError, match="unexpected extra"):
        layer.load_linen_params(dict(params, extra=jnp.zeros(3)))
    with pytest.raises(ValueError, match="does not broadcast to"):
        layer(x, mask=jnp.ones((B, 3, L, L), bool))
    with pytest.raises(ValueError, match="SBMAttention.num_hops is not an option"):
        sbm_nnx.SBMAttention(H, HD, D, rngs=nnx.Rngs(0), num_hops=2)
