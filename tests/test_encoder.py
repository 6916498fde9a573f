"""Encoder, pooling, heads and full attention against independent numpy references."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sbm_jax.attention import STATS_COLLECTION, build_attention
from sbm_jax.models import (
    ClassificationHead,
    TokenHead,
    build_model,
    dual_encoder_features,
    masked_mean_pool,
)


def model_config(**overrides) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(
        dict(
            vocab_size=11,
            max_len=12,
            emb_dim=8,
            num_layers=2,
            num_heads=2,
            head_dim=4,
            mlp_dim=16,
            attention="full",
            attention_options={},
            dropout=0.0,
            attention_dropout=0.0,
            pooling="mean",
            classifier_dim=6,
            num_classes=3,
            dtype="float32",
        )
    )
    cfg.update(overrides)
    return cfg


def jit_init(model, rngs, *args):
    """Unboxed model.init(rngs, *args, deterministic=True) as one compiled program."""
    return nn.unbox(jax.jit(lambda r, *a: model.init(r, *a, deterministic=True))(rngs, *args))


def jit_apply(model, **kwargs):
    """jax.jit of (variables, *args) -> model.apply(variables, *args, **kwargs)."""
    return jax.jit(lambda v, *a: model.apply(v, *a, **kwargs))


def numpy_attention(params, x, mask):
    """Naive multi-head softmax attention over real keys, in float64 numpy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    q = np.einsum("bld,dhk->blhk", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = np.einsum("bld,dhk->blhk", x, p["key"]["kernel"]) + p["key"]["bias"]
    v = np.einsum("bld,dhk->blhk", x, p["value"]["kernel"]) + p["value"]["bias"]
    scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhqs,bshk->bqhk", weights, v)
    return np.einsum("bqhk,hkd->bqd", out, p["out"]["kernel"]) + p["out"]["bias"]


def test_full_attention_matches_numpy_reference_and_sows_density():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    attn = build_attention("full", num_heads=2, head_dim=3, out_dim=8)
    variables = jit_init(attn, jax.random.PRNGKey(0), x, mask)
    apply = jit_apply(attn, deterministic=True, mutable=[STATS_COLLECTION])
    out, stats = apply({"params": variables["params"]}, x, mask)
    expected = numpy_attention(variables["params"], x.astype(np.float64), mask)
    np.testing.assert_allclose(np.asarray(out)[mask], expected[mask], rtol=1e-5, atol=1e-5)
    density = stats[STATS_COLLECTION]["density"][0]
    edges = stats[STATS_COLLECTION]["edges"][0]
    np.testing.assert_array_equal(density, np.ones((2, 2)))
    np.testing.assert_array_equal(edges, [[25, 25], [9, 9]])


def test_full_attention_dropout_uses_dropout_stream_and_is_inverted():
    x = np.random.default_rng(1).normal(size=(1, 6, 8)).astype(np.float32)
    mask = np.ones((1, 6), bool)
    attn = build_attention("full", num_heads=2, head_dim=4, out_dim=8, attention_dropout=0.5)
    params = jit_init(attn, jax.random.PRNGKey(0), x, mask)["params"]
    det = jit_apply(attn, deterministic=True)({"params": params}, x, mask)

    def dropped(key):
        return attn.apply({"params": params}, x, mask, deterministic=False, rngs={"dropout": key})

    one = jax.jit(dropped)
    a = one(jax.random.PRNGKey(1))
    b = one(jax.random.PRNGKey(2))
    assert not np.allclose(a, b)
    # Inverted dropout keeps the expectation: average many draws -> deterministic output.
    draws = jax.jit(jax.vmap(dropped))(jax.random.split(jax.random.PRNGKey(3), 500))
    draws = np.asarray(draws, np.float64)
    stderr = draws.std(axis=0) / np.sqrt(len(draws))
    assert np.all(np.abs(draws.mean(axis=0) - det) < 5 * stderr + 1e-6)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_padding_never_changes_real_token_outputs(pooling):
    model = build_model(model_config(pooling=pooling), "token")
    rng = np.random.default_rng(2)
    short = rng.integers(1, 11, size=(2, 7)).astype(np.int32)
    mask_short = np.ones((2, 7), bool)
    params = jit_init(model, jax.random.PRNGKey(0), short, mask_short)["params"]
    apply = jit_apply(model, deterministic=True)
    out_short = np.asarray(apply({"params": params}, short, mask_short))
    # Same sequences padded to 12 with arbitrary (non-zero) garbage ids.
    long = rng.integers(1, 11, size=(2, 12)).astype(np.int32)
    long[:, :7] = short
    mask_long = np.zeros((2, 12), bool)
    mask_long[:, :7] = True
    out_long = np.asarray(apply({"params": params}, long, mask_long))
    assert out_short.shape == (2, 7, 3) and out_long.shape == (2, 12, 3)
    np.testing.assert_allclose(out_long[:, :7], out_short, rtol=1e-5, atol=1e-5)
    # Sequence-level outputs (pooled) are also unchanged.
    clf = build_model(model_config(pooling=pooling), "classification")
    cparams = jit_init(clf, jax.random.PRNGKey(0), short, mask_short)["params"]
    capply = jit_apply(clf, deterministic=True)
    np.testing.assert_allclose(
        capply({"params": cparams}, long, mask_long),
        capply({"params": cparams}, short, mask_short),
        rtol=1e-5,
        atol=1e-5,
    )


def test_masked_mean_pool_averages_real_tokens_only():
    x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    mask = np.array([[1, 0, 1, 0], [0, 0, 0, 0]], bool)
    pooled = np.asarray(jax.jit(masked_mean_pool)(jnp.asarray(x), jnp.asarray(mask)))
    np.testing.assert_allclose(pooled[0], (x[0, 0] + x[0, 2]) / 2)
    np.testing.assert_array_equal(pooled[1], np.zeros(3))  # no real token -> zeros


def test_encoder_mean_and_cls_pooling_against_token_outputs():
    inputs = np.array([[3, 4, 5, 0], [6, 7, 0, 0]], np.int32)
    mask = inputs > 0
    for pooling in ("mean", "cls"):
        enc = build_model(model_config(pooling=pooling), "token").encoder
        variables = jit_init(enc, jax.random.PRNGKey(0), inputs, mask)
        tokens, out_mask, pooled = jax.tree.map(
            np.asarray,
            jit_apply(enc, deterministic=True)({"params": variables["params"]}, inputs, mask),
        )
        assert tokens.shape == (2, 4, 8) and pooled.shape == (2, 8)
        np.testing.assert_array_equal(out_mask, mask)
        if pooling == "mean":
            t = np.asarray(tokens)
            expected = np.stack([t[0, :3].mean(0), t[1, :2].mean(0)])
            np.testing.assert_allclose(pooled, expected, rtol=1e-5, atol=1e-6)
        else:
            assert "cls" in variables["params"]
            # The CLS output is an extra position: it differs from every token output.
            assert not np.allclose(pooled[:, None], tokens, atol=1e-3)


def test_classification_head_is_dense_relu_dense():
    x = np.random.default_rng(3).normal(size=(4, 5)).astype(np.float32)
    head = ClassificationHead(hidden_dim=7, num_classes=3)
    params = jax.jit(head.init)(jax.random.PRNGKey(0), x)["params"]
    p = jax.tree.map(np.asarray, params)
    hidden = np.maximum(x @ p["hidden"]["kernel"] + p["hidden"]["bias"], 0.0)
    expected = hidden @ p["logits"]["kernel"] + p["logits"]["bias"]
    np.testing.assert_allclose(
        jax.jit(head.apply)({"params": params}, x), expected, rtol=1e-5, atol=1e-5
    )


def test_token_head_shapes_and_transform():
    x = np.random.default_rng(4).normal(size=(2, 3, 5)).astype(np.float32)
    plain = TokenHead(num_classes=4)
    params = jax.jit(plain.init)(jax.random.PRNGKey(0), x)["params"]
    p = jax.tree.map(np.asarray, params)
    np.testing.assert_allclose(
        jax.jit(plain.apply)({"params": params}, x),
        x @ p["logits"]["kernel"] + p["logits"]["bias"],
        rtol=1e-5,
        atol=1e-5,
    )
    mlm = TokenHead(num_classes=4, hidden_dim=6)
    params = jax.jit(mlm.init)(jax.random.PRNGKey(0), x)["params"]
    assert set(params) == {"transform", "transform_ln", "logits"}
    assert jax.jit(mlm.apply)({"params": params}, x).shape == (2, 3, 4)


def test_dual_encoder_features_and_model():
    x0 = np.array([[1.0, 2.0]], np.float32)
    x1 = np.array([[3.0, -1.0]], np.float32)
    np.testing.assert_array_equal(
        jax.jit(dual_encoder_features)(x0, x1), [[1.0, 2.0, 3.0, -1.0, 3.0, -2.0, -2.0, 3.0]]
    )
    model = build_model(model_config(), "dual_encoder")
    a = np.array([[1, 2, 3, 0]], np.int32)
    b = np.array([[4, 5, 0, 0]], np.int32)
    params = jit_init(model, jax.random.PRNGKey(0), a, a > 0, b, b > 0)["params"]
    logits = jit_apply(model, deterministic=True)({"params": params}, a, a > 0, b, b > 0)
    assert logits.shape == (1, 3)

    @jax.jit  # one program, not op-by-op compiles
    def reference(params):
        # Run the shared encoder on each sequence alone, then the head.
        enc_params = {"params": params["encoder"]}
        _, _, p0 = model.encoder.apply(enc_params, a, a > 0, deterministic=True)
        _, _, p1 = model.encoder.apply(enc_params, b, b > 0, deterministic=True)
        return model.head.apply({"params": params["head"]}, dual_encoder_features(p0, p1))

    expected = reference(params)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_encoder_rejects_sequences_longer_than_max_len():
    model = build_model(model_config(max_len=4), "token")
    x = np.ones((1, 5), np.int32)
    with pytest.raises(ValueError, match="model.max_len"):
        model.init(jax.random.PRNGKey(0), x, x > 0, deterministic=True)


def test_encoder_with_sbm_attention_runs_and_sows_stats():
    from sbm_jax.attention import available

    if "sbm" not in available():
        pytest.skip("sbm attention not registered")
    cfg = model_config(attention="sbm", attention_options={"num_clusters": 4, "impl": "dense"})
    model = build_model(cfg, "token")
    x = np.array([[1, 2, 3, 4, 0, 0]], np.int32)
    rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}
    params = jit_init(model, rngs, x, x > 0)["params"]
    apply = jax.jit(
        lambda v, x, m, key: model.apply(
            v, x, m, deterministic=True, rngs={"sample": key}, mutable=[STATS_COLLECTION]
        )
    )
    out, stats = apply({"params": params}, x, x > 0, jax.random.PRNGKey(2))
    assert out.shape == (1, 6, 3)
    density = stats[STATS_COLLECTION]["encoder"]["block_0"]["attention"]["density"][0]
    assert density.shape == (1, 2)
    assert np.all((np.asarray(density) >= 0) & (np.asarray(density) <= 1))
