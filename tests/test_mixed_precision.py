"""bf16 compute with float32 parameters and softmax statistics, against float32.

Stated tolerances, a few times the error measured on these inputs: the edge kernels on
bf16 inputs match float32 compute on the same (bf16-representable) inputs to 2^-7
relative, twice one bf16 rounding of the output (measured: 0.0038 relative, the output's
own rounding, since the scores, softmax and accumulation stay float32); an encoder in
bf16 matches its float32 twin, same float32 parameters, to 0.02 in the logits of
0.11-1.02 (measured: 0.0052).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sbm_jax import EdgeList, dense_masked_attention, edge_attention
from sbm_jax.models.build import build_model

N, M, D = 12, 10, 8


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    # Values representable in bf16, so both runs see the same inputs.
    q, k, v = (
        jax.random.normal(kk, s).astype(jnp.bfloat16)
        for kk, s in zip(ks[:3], [(N, D), (M, D), (M, D)], strict=True)
    )
    mask = np.array(jax.random.uniform(ks[3], (N, M)) < 0.5)
    mask[3] = False
    return q, k, v, mask


def _edges(mask):
    rows, cols = np.nonzero(mask)
    return EdgeList(
        rows=jnp.asarray(rows, jnp.int32),
        cols=jnp.asarray(cols, jnp.int32),
        valid=jnp.asarray(np.ones(len(rows), bool)),
        probs=jnp.asarray(np.zeros(len(rows), np.float32)),
    )


def test_edge_and_dense_kernels_keep_float32_statistics():
    q, k, v, mask = _inputs()
    edges = _edges(mask)
    f32 = [np.asarray(a, np.float32) for a in (q, k, v)]
    for fn in (
        lambda a, b, c: edge_attention(a, b, c, edges),
        lambda a, b, c: dense_masked_attention(a, b, c, jnp.asarray(mask)),
    ):
        fn = jax.jit(fn)  # one program per dtype, not op-by-op compiles
        low = fn(q, k, v)
        ref = fn(*f32)
        assert low.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(low, np.float32), np.asarray(ref), rtol=2.0**-7, atol=1e-4
        )
        assert np.all(np.asarray(low, np.float32)[3] == 0.0)


def _model_config(dtype: str) -> ml_collections.ConfigDict:
    model = ml_collections.ConfigDict()
    model.vocab_size = 50
    model.max_len = 16
    model.emb_dim = 16
    model.num_layers = 2
    model.num_heads = 2
    model.head_dim = 8
    model.mlp_dim = 32
    model.dropout = 0.0
    model.attention_dropout = 0.0
    model.pooling = "mean"
    model.classifier_dim = 16
    model.num_classes = 3
    model.attention = "full"
    model.attention_options = ml_collections.ConfigDict()
    model.dtype = dtype
    return model


def test_bf16_encoder_matches_float32_with_float32_params():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 1, 50)
    mask = jnp.asarray(np.arange(16)[None, :] < np.array([[16], [12], [9], [16]]))
    f32_model = build_model(_model_config("float32"), "classification")
    bf16_model = build_model(_model_config("bfloat16"), "classification")
    # Each init / apply is one jitted program, not op-by-op compiles.
    init = jax.jit(lambda key: nn.unbox(f32_model.init(key, tokens, mask, deterministic=True)))
    params = init(jax.random.PRNGKey(0))["params"]
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    ref = jax.jit(lambda p: f32_model.apply({"params": p}, tokens, mask, deterministic=True))(
        params
    )
    low = jax.jit(lambda p: bf16_model.apply({"params": p}, tokens, mask, deterministic=True))(
        params
    )
    assert np.isfinite(np.asarray(low, np.float32)).all()
    np.testing.assert_allclose(np.asarray(low, np.float32), np.asarray(ref), atol=0.02)
