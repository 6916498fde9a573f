"""SBMOptions: the SBM core's one static argument, built by the layer and checked once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax import SBMAttention
from sbm_jax.attention.sbm import SBMOptions, sbm_attention_core


def test_the_layer_builds_its_core_options_from_its_fields():
    layer = SBMAttention(
        num_heads=2, head_dim=4, edge_law="poisson", attention_dropout=0.1, window=4,
        capacity_buckets=(0.25, 0.5), impl="sparse", kernel="segment", stream_rows=8,
    )  # fmt: skip
    train, evaluate = layer.core_options(deterministic=False), layer.core_options()
    assert train.law == "poisson" and train.dropout_rate == 0.1
    assert evaluate.dropout_rate == 0.0
    for field in dataclasses.fields(SBMOptions):
        if field.name not in ("law", "dropout_rate"):
            assert getattr(train, field.name) == getattr(layer, field.name), field.name


def test_equal_options_are_equal_static_arguments_once_resolved():
    # A config's list of buckets or a NumPy integer must not compile a second program.
    loose = SBMOptions(capacity_buckets=[0.5], window=np.int64(2), dense_below=np.int32(0))
    plain = SBMOptions(capacity_buckets=(0.5,), window=2)
    assert loose.resolved() == plain.resolved()
    assert hash(loose.resolved()) == hash(plain.resolved())
    assert type(loose.resolved().window) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.window = 4  # type: ignore[misc]


def test_the_layer_check_names_its_own_fields():
    with pytest.raises(ValueError, match="edge_law='nope' is not an edge law"):
        SBMAttention(num_heads=1, head_dim=4, edge_law="nope").validate()
    with pytest.raises(ValueError, match="capacity_buckets must be strictly increasing"):
        SBMAttention(num_heads=1, head_dim=4, capacity_buckets=(0.5, 0.25)).validate()
    with pytest.raises(ValueError, match="stream_slots=3 is too small"):
        SBMAttention(num_heads=1, head_dim=4, stream_rows=8, stream_slots=3).validate()
    # The core called with keywords names its own argument, as it did.
    with pytest.raises(ValueError, match="law='nope' is not an edge law"):
        SBMOptions(law="nope").resolved()


def test_the_core_takes_options_or_their_fields_not_both():
    x = jnp.zeros((1, 1, 4, 2))
    memb, block, mask = jnp.zeros((1, 1, 4, 3)), jnp.zeros((1, 3, 3)), jnp.ones((1, 4), bool)
    with pytest.raises(TypeError, match=r"not both.*\['impl'\]"):
        sbm_attention_core(
            jax.random.PRNGKey(0), x, x, x, memb, block, memb, mask,
            delta=0.0, options=SBMOptions(), impl="dense",
        )  # fmt: skip
