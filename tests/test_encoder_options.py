"""The Sparse Transformer's training aids as encoder options: remat and scaled init.

References: remat must not change the function, so loss and gradients are compared with
the same model without remat; the scaled init is checked against its closed form
(std = factor / sqrt(fan_in) for a LeCun-normal kernel) with a statistical bound, and
every other parameter against the unscaled model's (bitwise equal).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sbm_jax.attention import STATS_COLLECTION
from sbm_jax.layers.tt import tt_cores_of, tt_to_dense
from sbm_jax.models import Encoder, build_encoder
from sbm_jax.models.encoder import (
    scale_output_projection,
    scaled_residual_factor,
    sinusoidal_positions,
)

SMALL = dict(vocab_size=13, max_len=10, emb_dim=8, num_heads=2, head_dim=4, mlp_dim=16)


def _inputs(batch: int = 2, length: int = 10):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 13, (batch, length)), jnp.int32)
    mask = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [length - 3]]))
    return tokens, mask


def _init(model: Encoder, tokens, mask):
    rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}
    init = jax.jit(lambda r, t, m: model.init(r, t, m, deterministic=True))  # one program
    return nn.unbox(init(rngs, tokens, mask))["params"]


@pytest.mark.parametrize(
    "attention, options, num_layers",
    [
        # suite time (~14 s each): both run with -m slow.
        pytest.param("full", {}, 2, marks=pytest.mark.slow),
        pytest.param(  # graph sampling under remat: same 'sample' rng, same graph
            "sbm", {"num_clusters": 4, "impl": "dense"}, 1, marks=pytest.mark.slow
        ),
    ],
)
def test_remat_gives_identical_loss_gradients_and_stats(attention, options, num_layers):
    tokens, mask = _inputs()
    common = dict(SMALL, num_layers=num_layers, attention=attention, attention_options=options)
    plain = Encoder(**common)
    remat = Encoder(**common, remat=True)
    params = _init(plain, tokens, mask)
    # Same parameter tree and values: remat is not a parameter change.
    params_remat = _init(remat, tokens, mask)
    assert jax.tree.structure(params) == jax.tree.structure(params_remat)
    jax.tree.map(np.testing.assert_array_equal, params, params_remat)

    target = jax.random.normal(jax.random.PRNGKey(2), (2, 10, 8))

    def loss_fn(model):
        def loss(p):
            (tokens_out, _, _), stats = model.apply(
                {"params": p},
                tokens,
                mask,
                deterministic=False,
                rngs={"sample": jax.random.PRNGKey(3), "dropout": jax.random.PRNGKey(4)},
                mutable=[STATS_COLLECTION],
            )
            value = jnp.sum(jnp.where(mask[..., None], (tokens_out - target) ** 2, 0.0))
            return value, stats

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (loss_a, stats_a), grads_a = loss_fn(plain)(params)
    (loss_b, stats_b), grads_b = loss_fn(remat)(params)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6, atol=0)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), grads_a, grads_b
    )
    jax.tree.map(np.testing.assert_array_equal, stats_a, stats_b)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads_b))

    if attention == "full":  # sbm has checkpoints of its own inside
        # The rematerialised program really contains the checkpoint primitive.
        jaxpr = str(jax.make_jaxpr(lambda p: loss_fn(remat)(p)[1])(params))
        assert "checkpoint" in jaxpr or "remat" in jaxpr
        jaxpr_plain = str(jax.make_jaxpr(lambda p: loss_fn(plain)(p)[1])(params))
        assert "checkpoint" not in jaxpr_plain and "remat" not in jaxpr_plain


def _step_temp_bytes(num_layers: int, remat: bool, n: int = 256) -> int:
    """Compiled temp bytes of a training step's gradient (full attention, no dropout)."""
    model = Encoder(
        vocab_size=13,
        max_len=n,
        emb_dim=32,
        num_layers=num_layers,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        attention="full",
        attention_options={"implementation": "chunked"},
        remat=remat,
    )
    tokens = jnp.ones((2, n), jnp.int32)
    mask = jnp.ones((2, n), bool)
    params = _init(model, tokens[:, :8], mask[:, :8])

    def loss(p, tokens, mask):
        _, _, pooled = model.apply({"params": p}, tokens, mask, deterministic=False)
        return jnp.sum(pooled**2)

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_remat_cuts_the_memory_each_block_holds_between_the_passes():
    # What one more block adds to a step's temp bytes: its activations kept for the
    # backward pass, unless remat recomputes them there. On XLA:CPU plain nn.remat
    # saved nothing (3.1 MiB per block at n=256 with and without it: XLA expands the
    # barrier and merges the recomputation with the forward pass); the encoder's remat
    # waits for the cotangent (sbm_jax/_remat.py): 0.09 MiB per block.
    per_block = {
        remat: _step_temp_bytes(2, remat) - _step_temp_bytes(1, remat) for remat in (False, True)
    }
    assert per_block[False] > 2**20, per_block  # the case keeps something worth saving
    assert per_block[True] <= 0.25 * per_block[False], per_block


def _std_bound(values: np.ndarray, expected_std: float) -> None:
    """|sample std / expected - 1| within 6 standard errors (SE of a std ~ 1/sqrt(2N))."""
    n = values.size
    ratio = float(np.sqrt(np.mean(np.asarray(values, np.float64) ** 2))) / expected_std
    assert abs(ratio - 1.0) < 6.0 / math.sqrt(2 * n), (ratio, n)


def test_scaled_residual_init_std_and_other_params_unchanged():
    num_layers = 3
    dims = dict(vocab_size=13, max_len=10, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
    tokens, mask = _inputs()
    base = _init(Encoder(**dims, num_layers=num_layers), tokens, mask)
    scaled = _init(Encoder(**dims, num_layers=num_layers, scaled_residual_init=True), tokens, mask)
    assert jax.tree.structure(base) == jax.tree.structure(scaled)
    factor = 1.0 / math.sqrt(2 * num_layers)
    assert scaled_residual_factor(num_layers) == pytest.approx(factor)

    residual = {("attention", "out", "kernel"), ("mlp", "fc2", "kernel")}
    checked = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(scaled)[0]:
        keys = tuple(p.key for p in path)
        other = base
        for k in keys:
            other = other[k]
        if keys[0].startswith("block_") and keys[1:] in residual:
            # LeCun normal: std 1/sqrt(fan_in); fan_in = heads*head_dim or mlp_dim.
            fan_in = 32 if keys[1] == "attention" else 64
            _std_bound(np.asarray(leaf), factor / math.sqrt(fan_in))
            _std_bound(np.asarray(other), 1.0 / math.sqrt(fan_in))
            checked.add(keys[1:])
        else:
            np.testing.assert_array_equal(leaf, other, err_msg=str(keys))
    assert checked == residual
    # Pooled over layers, the scaled kernels also pass the bound with more samples.
    pooled = np.concatenate(
        [np.asarray(scaled[f"block_{i}"]["attention"]["out"]["kernel"]).ravel() for i in range(3)]
    )
    _std_bound(pooled, factor / math.sqrt(32))


def test_scaled_init_scales_the_tt_output_matrix_of_tsa():
    tokens, mask = _inputs()
    common = dict(SMALL, num_layers=2, attention="tsa", attention_options={})
    base = _init(Encoder(**common), tokens, mask)
    scaled = _init(Encoder(**common, scaled_residual_init=True), tokens, mask)
    dense = jax.jit(lambda p: tt_to_dense(tt_cores_of(p)))
    for layer in ("block_0", "block_1"):
        w_base = dense(base[layer]["attention"]["out"])
        w_scaled = dense(scaled[layer]["attention"]["out"])
        np.testing.assert_allclose(w_scaled, 0.5 * w_base, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(
            scaled[layer]["attention"]["key"]["core_0"], base[layer]["attention"]["key"]["core_0"]
        )


def test_scale_output_projection_errors_name_the_field():
    with pytest.raises(ValueError, match="model.scaled_residual_init.*'out'"):
        scale_output_projection({"params": {"proj": {}}}, scale=0.5, attention="custom")
    with pytest.raises(ValueError, match="model.num_layers"):
        scaled_residual_factor(0)


def test_build_encoder_reads_the_flags_and_rejects_non_bools():
    model = ml_collections.ConfigDict(
        dict(
            SMALL,
            num_layers=1,
            attention="full",
            attention_options={},
            dropout=0.0,
            attention_dropout=0.0,
            pooling="mean",
            dtype="float32",
            remat=True,
            scaled_residual_init=True,
        ),
        type_safe=False,
    )
    encoder = build_encoder(model)
    assert encoder.remat and encoder.scaled_residual_init
    model.remat = 1
    with pytest.raises(ValueError, match="model.remat"):
        build_encoder(model)
    del model["remat"]
    del model["scaled_residual_init"]
    encoder = build_encoder(model)  # both optional, default off
    assert not encoder.remat and not encoder.scaled_residual_init


def test_config_validation_names_non_bool_flags():
    from configs import synthetic as synthetic_config
    from sbm_jax.training import ConfigError, validate_config

    config = synthetic_config.get_config("full,smoke")
    assert config.model.remat is False and config.model.scaled_residual_init is False
    validate_config(config, device_count=1)  # the defaults pass
    bad = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
    bad.model.scaled_residual_init = "yes"
    with pytest.raises(ConfigError, match="model.scaled_residual_init='yes'"):
        validate_config(bad, device_count=1)


def test_tied_query_key_init_copies_query_and_leaves_the_rest():
    tokens, mask = _inputs()
    base = _init(Encoder(**SMALL, num_layers=2), tokens, mask)
    tied = _init(Encoder(**SMALL, num_layers=2, query_key_init="tied"), tokens, mask)
    assert jax.tree.structure(base) == jax.tree.structure(tied)
    for layer in ("block_0", "block_1"):
        attn, base_attn = tied[layer]["attention"], base[layer]["attention"]
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(attn["key"][leaf], attn["query"][leaf])
            np.testing.assert_array_equal(attn["query"][leaf], base_attn["query"][leaf])
        # the independent draw really differs, so the copy is what made them equal
        assert not np.allclose(base_attn["key"]["kernel"], base_attn["query"]["kernel"])
    # every parameter outside the key projections is the untied draw
    for path, leaf in jax.tree_util.tree_flatten_with_path(tied)[0]:
        keys = tuple(p.key for p in path)
        if "key" in keys:
            continue
        other = base
        for k in keys:
            other = other[k]
        np.testing.assert_array_equal(leaf, other, err_msg=str(keys))


def test_tied_init_makes_the_step_zero_scores_a_gram_matrix():
    # With W_k = W_q (and b_k = b_q) the scores q_i . k_j are the Gram matrix of the
    # queries: positive semi-definite, so equal inputs score alike from step 0.
    tokens, mask = _inputs()
    encoder = Encoder(**SMALL, num_layers=1, query_key_init="tied")
    params = _init(encoder, tokens, mask)
    attn = params["block_0"]["attention"]

    @jax.jit  # one program, not op-by-op compiles
    def scores_gram_min_eig(attn):
        x = jax.random.normal(jax.random.key(3), (6, SMALL["emb_dim"]))
        q = jnp.einsum("ld,dhk->lhk", x, attn["query"]["kernel"]) + attn["query"]["bias"]
        k = jnp.einsum("ld,dhk->lhk", x, attn["key"]["kernel"]) + attn["key"]["bias"]
        scores = jnp.einsum("lhk,mhk->hlm", q, k)
        gram = jnp.einsum("lhk,mhk->hlm", q, q)
        return scores, gram, jnp.min(jnp.linalg.eigvalsh(scores))

    scores, gram, min_eig = scores_gram_min_eig(attn)
    np.testing.assert_allclose(scores, gram, rtol=1e-6, atol=1e-6)
    assert float(min_eig) > -1e-5


def test_tied_init_refuses_a_mechanism_without_separate_projections():
    tokens, mask = _inputs()
    encoder = Encoder(**SMALL, num_layers=1, attention="reformer", query_key_init="tied")
    with pytest.raises(ValueError, match="model.query_key_init='tied'.*'query' and 'key'"):
        _init(encoder, tokens, mask)


def test_position_embedding_choices_and_final_norm():
    tokens, mask = _inputs()
    learned = _init(Encoder(**SMALL, num_layers=1), tokens, mask)
    none = _init(Encoder(**SMALL, num_layers=1, position_embedding="none"), tokens, mask)
    sinus = _init(Encoder(**SMALL, num_layers=1, position_embedding="sinusoidal"), tokens, mask)
    assert "pos_embed" in learned and "pos_embed" not in none and "pos_embed" not in sinus
    no_norm = _init(Encoder(**SMALL, num_layers=1, final_norm=False), tokens, mask)
    assert "ln_final" in learned and "ln_final" not in no_norm
    with pytest.raises(ValueError, match="model.position_embedding='rotary'"):
        _init(Encoder(**SMALL, num_layers=1, position_embedding="rotary"), tokens, mask)


def test_sinusoidal_table_matches_the_closed_form():
    table = np.asarray(jax.jit(sinusoidal_positions, static_argnums=(0, 1))(7, 6))
    for pos in range(7):
        for i in range(3):
            angle = pos / 10000.0 ** (2 * i / 6)
            np.testing.assert_allclose(table[pos, 2 * i], math.sin(angle), atol=1e-6)
            np.testing.assert_allclose(table[pos, 2 * i + 1], math.cos(angle), atol=1e-6)


def test_build_encoder_reads_the_new_fields_and_names_bad_values():
    from configs import synthetic as synthetic_config

    config = synthetic_config.get_config("smoke")
    encoder = build_encoder(config.model)
    assert encoder.query_key_init == config.model.query_key_init
    assert encoder.position_embedding == config.model.position_embedding
    assert encoder.final_norm == config.model.final_norm
    bad = synthetic_config.get_config("smoke")
    bad.model.query_key_init = "shared"
    with pytest.raises(ValueError, match="model.query_key_init='shared'"):
        build_encoder(bad.model)
