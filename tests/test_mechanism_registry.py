"""One registry entry per attention mechanism: module, analytic counts and option defaults."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from sbm_jax.analysis import attention_flops, attention_param_count
from sbm_jax.attention import (
    COMMON_FIELDS,
    available,
    build_attention,
    get_attention,
    get_mechanism,
    option_defaults,
    register,
    registry,
)

BUILTIN = {
    "full",
    "linear",
    "linformer",
    "local",
    "nystromformer",
    "performer",
    "reformer",
    "sbm",
    "sparse_fixed",
    "sparse_strided",
    "tsa",
}

# (mechanism, options): every option that changes the parameter tree, at small sizes.
PARAM_CASES = [
    ("full", {}),
    ("linear", {}),
    ("linformer", {"proj_len": 3, "max_len": 12}),
    ("linformer", {"proj_len": 3, "max_len": 12, "share_kv": True}),
    ("local", {"window": 4}),
    ("nystromformer", {"num_landmarks": 4, "conv_kernel_size": 3}),
    ("nystromformer", {"num_landmarks": 4, "conv_kernel_size": 0}),
    ("performer", {"num_features": 8}),
    ("reformer", {"chunk_len": 4}),
    ("sbm", {"num_clusters": 3}),
    ("sbm", {"num_clusters": 3, "shared_mlp": True}),
    ("sparse_fixed", {"stride": 3, "c": 1}),
    ("sparse_strided", {"stride": 3}),
    ("tsa", {}),
    ("tsa", {"tt_rank": 3, "use_bias": True}),
    ("tsa", {"projection": "dense", "use_bias": True}),
    ("tsa", {"projection": "dense"}),
]


def test_every_builtin_mechanism_has_one_complete_entry():
    assert BUILTIN <= set(available())
    for name in available():
        entry = get_mechanism(name)
        assert entry.name == name and get_attention(name) is entry.module
        assert callable(entry.flops) and callable(entry.params), name


def test_param_cases_cover_every_registered_mechanism():
    assert {n for n, _ in PARAM_CASES} == set(available())


@pytest.mark.parametrize("name, options", PARAM_CASES)
def test_analytic_param_count_equals_a_real_init(name, options):
    n, D, H, d = 12, 8, 2, 4
    module = build_attention(name, options=options, num_heads=H, head_dim=d, out_dim=D)
    x = jax.random.normal(jax.random.key(0), (1, n, D))
    mask = jnp.ones((1, n), bool)
    key = jax.random.key(1)
    # The parameter tree ``init`` builds, traced abstractly (nothing computed): the test
    # stays fast while counting exactly the leaves a concrete init creates.
    variables = jax.eval_shape(
        lambda: module.init({"params": key, "sample": key}, x, mask, deterministic=True)
    )
    real = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(variables["params"]))
    analytic = attention_param_count(
        name, seq_len=n, emb_dim=D, num_heads=H, head_dim=d, options=options
    )
    assert analytic == real


def test_option_defaults_are_the_module_fields():
    # Written out by hand from the class bodies: the registry derives them, once.
    assert option_defaults("linformer") == {"proj_len": 256, "max_len": 4096, "share_kv": False}
    assert option_defaults("full") == {"implementation": "auto", "query_chunk": 0}
    assert option_defaults("local") == {"window": 64, "causal": False}
    assert option_defaults("sparse_fixed") == {
        "stride": None,
        "causal": False,
        "impl": "blocked",
        "c": None,
        "distinct_summaries": False,
    }
    for name in available():
        defaults = option_defaults(name)
        assert not set(defaults) & set(COMMON_FIELDS) and "parent" not in defaults
        fields = {f.name: f for f in dataclasses.fields(get_attention(name))}
        assert all(defaults[k] == fields[k].default for k in defaults), name
        # A mechanism built from its defaults alone carries exactly those values.
        module = build_attention(name, options=defaults, num_heads=2, head_dim=4, out_dim=8)
        assert all(getattr(module, k) == v for k, v in defaults.items()), name


def test_option_check_names_the_field_and_lists_the_options():
    with pytest.raises(ValueError, match=r"model\.attention_options\.window .*'sparse_strided'"):
        build_attention("sparse_strided", options={"window": 8}, num_heads=2, head_dim=4)
    # A common field passed both ways is an option error, not a TypeError.
    with pytest.raises(ValueError, match=r"attention_options\.num_heads"):
        build_attention("full", options={"num_heads": 2}, num_heads=2, head_dim=4, out_dim=8)
    entry = get_mechanism("local")
    with pytest.raises(ValueError, match=r"its options are \[.*'causal', .*'window'\]"):
        entry.check_options({"stride": 2})
    assert entry.resolve_options({"window": 8}) == {"window": 8, "causal": False}
    with pytest.raises(ValueError, match="model.attention='nope' is not a known attention"):
        get_mechanism("nope")


def test_length_options_size_linformer_to_the_sequence():
    assert get_mechanism("linformer").length_options(300) == {"max_len": 300}
    assert get_mechanism("full").length_options is None


def test_register_keeps_one_entry_per_name(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    class Toy(nn.Module):
        num_heads: int
        head_dim: int
        out_dim: int
        attention_dropout: float = 0.0
        dtype: jnp.dtype = jnp.float32
        width: int = 3

    assert register("toy", params=lambda n, D, H, d, o: 7)(Toy) is Toy
    assert option_defaults("toy") == {"width": 3}
    assert get_mechanism("toy").flops is None
    with pytest.raises(ValueError, match="'toy' is registered but has no FLOP formula"):
        attention_flops("toy", seq_len=4, emb_dim=8, num_heads=2, head_dim=4)
    count = attention_param_count("toy", seq_len=4, emb_dim=8, num_heads=2, head_dim=4)
    assert count == 7
    with pytest.raises(ValueError, match="registered twice"):
        register("full")(Toy)

    class NoHeads(nn.Module):
        width: int = 3

    with pytest.raises(TypeError, match="lacks the fields"):
        register("no_heads")(NoHeads)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_mechanism_names_a_bad_field_or_input_before_tracing(name):
    """The fields all mechanisms share and the input shapes are checked the same way
    everywhere: a ValueError naming the field (a zero head count used to surface as a
    ZeroDivisionError in an initializer, a rank-2 x as a message about the mask or a
    chex AssertionError, an empty sequence from a reduction inside jax, attention
    dropout 1.5 as an all-zero output)."""
    options = dict(next(o for n, o in PARAM_CASES if n == name))
    x, mask = jnp.ones((2, 12, 8)), jnp.ones((2, 12), bool)
    rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}

    def init(x=x, mask=mask, **fields):
        kwargs = dict(num_heads=2, head_dim=4, out_dim=8) | fields
        layer = build_attention(name, options=options, **kwargs)
        return layer.init(rngs, x, mask, deterministic=True)

    for field, value in (("num_heads", 0), ("head_dim", 0), ("out_dim", -1)):
        with pytest.raises(ValueError, match=f"{field} must be an int >= 1, got {value}"):
            init(**{field: value})
    with pytest.raises(ValueError, match=r"attention_dropout must lie in \[0, 1\), got 1.5"):
        init(attention_dropout=1.5)
    with pytest.raises(ValueError, match=r"x must be \[batch, length, dim\], got shape \(12, 8\)"):
        init(x=x[0], mask=mask[0])
    with pytest.raises(ValueError, match="at least one position"):
        init(x=x[:, :0], mask=mask[:, :0])
    with pytest.raises(ValueError, match=r"mask shape \(2, 11\) must equal"):
        init(mask=mask[:, :11])
    # A NumPy integer is an int (configs read from YAML or arrays give them).
    import numpy as np

    variables = init(num_heads=np.int64(2))
    assert jax.tree.leaves(variables)


# A float where an integer option is expected used to run silently (local window 2.5)
# or fail deep inside jax (a shape or pad width of floats); every baseline's validate()
# now names the field before anything is traced.
FLOAT_FOR_INT_OPTIONS = [
    ("linformer", {"proj_len": 4.0}, "proj_len"),
    ("local", {"window": 2.5}, "window"),
    ("nystromformer", {"num_landmarks": 4.0}, "num_landmarks"),
    ("nystromformer", {"pinv_iterations": 2.0}, "pinv_iterations"),
    ("performer", {"num_features": 16.0}, "num_features"),
    ("reformer", {"chunk_len": 4.0}, "chunk_len"),
    ("reformer", {"num_hashes": 2.0}, "num_hashes"),
    ("reformer", {"num_buckets": 4.0}, "num_buckets"),
    ("sparse_strided", {"stride": 3.0}, "stride"),
    ("sparse_fixed", {"stride": 3, "c": 2.0}, "c"),
]


@pytest.mark.parametrize("name, options, field", FLOAT_FOR_INT_OPTIONS)
def test_float_for_an_integer_option_names_the_field(name, options, field):
    x, mask = jnp.ones((1, 10, 8)), jnp.ones((1, 10), bool)

    def init():
        layer = build_attention(name, options=options, num_heads=2, head_dim=4, out_dim=8)
        return layer.init(jax.random.PRNGKey(0), x, mask, deterministic=True)

    value = next(iter(v for k, v in options.items() if k == field))
    with pytest.raises(ValueError, match=rf"attention_options\.{field} must be an int .*{value}"):
        jax.eval_shape(init)
