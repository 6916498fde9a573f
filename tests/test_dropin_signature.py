"""Every mechanism takes flax's MultiHeadAttention call next to today's ``(x, mask)``; a
mask or cross-attention it cannot honour is refused in one line, never dropped.

Cross-attention (queries of one length, keys and values of another, a key-padding mask)
is checked against float64 numpy references computed from the layer's own parameters,
through the Linen and the NNX face, and for ``full`` against flax's own
``MultiHeadDotProductAttention``, which has the same parameter tree and call."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbm_jax import nnx as sbm_nnx
from sbm_jax.attention import available, build_attention
from sbm_jax.attention._projections import CROSS_ATTENTION
from tests.attention_testing import softmax_attention, to64
from tests.test_mechanism_registry import PARAM_CASES

B, L, D, H, HD = 2, 6, 8, 2, 4


def _setup():
    x = jax.random.normal(jax.random.key(0), (B, L, D))
    mask = jnp.arange(L)[None, :] < jnp.array([[L], [L - 2]])
    layer = build_attention("full", num_heads=H, head_dim=HD, out_dim=D)
    params = layer.init(jax.random.key(1), x, mask, deterministic=True)
    return layer, params, x, mask


def test_key_mask_forms_equal_flax_multihead_attention():
    layer, params, x, mask = _setup()
    # flax's own MultiHeadDotProductAttention has the same query/key/value/out tree.
    ref = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * HD, out_features=D)
    want = ref.apply(nn.unbox(params), x, mask=mask[:, None, None, :], deterministic=True)
    real = np.asarray(mask)[..., None]
    for kwargs in (
        {"mask": mask[:, None, None, :]},
        {"mask": jnp.broadcast_to(mask[:, None, None, :], (B, H, L, L))},
    ):
        got = layer.apply(params, x, x, x, deterministic=True, **kwargs)
        np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5)
    legacy = layer.apply(params, x, mask, deterministic=True)
    np.testing.assert_allclose(np.where(real, legacy, 0), np.where(real, want, 0), atol=1e-5)


def test_unhonourable_masks_and_cross_attention_are_refused():
    layer, params, x, mask = _setup()
    causal = jnp.tril(jnp.ones((L, L), bool))[None, None]
    with pytest.raises(ValueError, match="honours only a key-padding mask"):
        layer.apply(params, x, mask=causal, deterministic=True)
    with pytest.raises(ValueError, match="does not broadcast to"):
        layer.apply(params, x, mask=jnp.ones((B, 3, L, L), bool), deterministic=True)
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\) must equal the keys'"):
        layer.apply(params, x, x, mask=mask[:, :4], deterministic=True)
    with pytest.raises(ValueError, match="mask= too"):
        layer.apply(params, x, mask, mask=mask, deterministic=True)
    traced = jax.jit(lambda m: layer.apply(params, x, mask=m, deterministic=True))
    with pytest.raises(ValueError, match="honours only a key-padding mask"):
        traced(jnp.broadcast_to(mask[:, None, None, :], (B, H, L, L)))


# --- cross-attention -------------------------------------------------------------------

Q, K = 5, 7  # query and key lengths
KEY_LENGTHS = (K, 3)  # real keys per example


def _cross_inputs():
    kq, kk, kv = jax.random.split(jax.random.key(10), 3)
    x_q = jax.random.normal(kq, (B, Q, D))
    x_k = jax.random.normal(kk, (B, K, D))
    x_v = jax.random.normal(kv, (B, K, D))
    key_mask = jnp.arange(K)[None, :] < jnp.array(KEY_LENGTHS)[:, None]
    return x_q, x_k, x_v, key_mask


def _project(params, x, name):
    p = to64(nn.unbox(params)["params"])[name]
    return np.einsum("bnc,chd->bnhd", np.asarray(x, np.float64), p["kernel"]) + p["bias"]


def _out(params, y):
    p = to64(nn.unbox(params)["params"])["out"]
    return np.einsum("bnhd,hdo->bno", y, p["kernel"]) + p["bias"]


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _kernel_attention(phi_q, phi_k, v, key_mask, eps=0.0):
    """sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps), real keys j only,
    as the dense [B, H, q, k] matrix of kernel values."""
    scores = np.einsum("bihm,bjhm->bhij", phi_q, phi_k)
    scores = np.where(np.asarray(key_mask)[:, None, None, :], scores, 0.0)
    return np.einsum("bhij,bjhe->bihe", scores, v) / (scores.sum(-1)[..., None] + eps).transpose(
        0, 2, 1, 3
    )


def _reference(name, options, params, x_q, x_k, x_v, key_mask, features=None):
    """Float64 numpy cross-attention of mechanism ``name`` from its own parameters."""
    q, k = _project(params, x_q, "query"), _project(params, x_k, "key")
    v = _project(params, x_v, "value")
    if name == "full":
        y = softmax_attention(q, k, v, key_mask)
    elif name == "linear":
        y = _kernel_attention(_elu1(q), _elu1(k), v, key_mask, eps=options.get("eps", 1e-6))
    else:  # performer, relu kernel: phi(x) = (relu(x d^-1/4 W^T) + eps) / sqrt(m)
        w = np.asarray(features, np.float64)
        eps = options.get("kernel_epsilon", 1e-4)

        def phi(x):
            return (np.maximum(x * HD**-0.25 @ w.T, 0.0) + eps) / np.sqrt(w.shape[0])

        y = _kernel_attention(phi(q), phi(k), v, key_mask)
    return _out(params, y)


CROSS_CASES = [
    ("full", {"implementation": "xla"}),
    ("full", {"implementation": "chunked", "query_chunk": 2}),  # 3 blocks, the last padded
    ("full", {"implementation": "auto"}),
    ("linear", {}),
    ("performer", {"num_features": 8, "redraw": False}),
]


@pytest.mark.parametrize("name, options", CROSS_CASES)
def test_cross_attention_equals_a_dense_reference_in_both_faces(name, options):
    x_q, x_k, x_v, key_mask = _cross_inputs()
    layer = build_attention(name, options=options, num_heads=H, head_dim=HD, out_dim=D)
    params = layer.init(jax.random.key(1), x_q, x_k, x_v, mask=key_mask, deterministic=True)
    features = None
    if name == "performer":  # the fixed features this layer draws, as it sows them
        _, sown = layer.apply(
            params, x_q, x_k, x_v, mask=key_mask, deterministic=True, mutable=["intermediates"]
        )
        (features,) = sown["intermediates"]["features"]
    want = _reference(name, options, params, x_q, x_k, x_v, key_mask, features)
    mask4 = key_mask[:, None, None, :]
    calls = {
        "[batch, k] mask": lambda: layer.apply(
            params, x_q, x_k, x_v, mask=key_mask, deterministic=True
        ),
        "[batch, 1, 1, k] mask, jitted": lambda: jax.jit(
            lambda p, q, k, v, m: layer.apply(p, q, k, v, mask=m, deterministic=True)
        )(params, x_q, x_k, x_v, mask4),
        "[batch, heads, q, k] mask": lambda: layer.apply(
            params,
            x_q,
            x_k,
            x_v,
            mask=jnp.broadcast_to(mask4, (B, H, Q, K)),
            deterministic=True,
        ),
    }
    for what, call in calls.items():
        got = call()
        assert got.shape == (B, Q, D), what
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=what)
    # The NNX face, on the same parameters: the same call, the same result.
    face = sbm_nnx.build_attention(
        name, num_heads=H, head_dim=HD, in_features=D, rngs=nnx.Rngs(0), options=options
    )
    face.load_linen_params(params["params"])
    got = face(x_q, x_k, x_v, mask=mask4, deterministic=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg="nnx")
    got = nnx.jit(lambda f, q, k, v, m: f(q, k, v, mask=m, deterministic=True))(
        face, x_q, x_k, x_v, key_mask
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg="nnx.jit")


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_full_cross_attention_equals_flax_multihead_attention_in_both_faces(implementation):
    x_q, x_k, x_v, key_mask = _cross_inputs()
    options = {"implementation": implementation, "query_chunk": 2}
    layer = build_attention("full", options=options, num_heads=H, head_dim=HD, out_dim=D)
    params = layer.init(jax.random.key(2), x_q, x_k, x_v, mask=key_mask, deterministic=True)
    ref = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * HD, out_features=D)
    mask4 = key_mask[:, None, None, :]
    for args in ((x_q, x_k, x_v), (x_q, x_k)):  # inputs_v defaults to inputs_k in both
        want = ref.apply(nn.unbox(params), *args, mask=mask4, deterministic=True)
        got = layer.apply(params, *args, mask=mask4, deterministic=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The NNX faces: ours and flax's nnx.MultiHeadAttention (the same tree), one call.
    face = sbm_nnx.FullAttention(H, HD, D, rngs=nnx.Rngs(0), **options)
    face.load_linen_params(params["params"])
    theirs = nnx.MultiHeadAttention(
        num_heads=H, in_features=D, qkv_features=H * HD, out_features=D, decode=False,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    state = nnx.state(theirs, nnx.Param)
    nnx.replace_by_pure_dict(state, nn.unbox(params["params"]))
    nnx.update(theirs, state)
    want = theirs(x_q, x_k, x_v, mask=mask4, deterministic=True)
    got = face(x_q, x_k, x_v, mask=mask4, deterministic=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Gradients too (chunked recomputes each block in the backward pass).
    loss = lambda f: (
        lambda p, q, k: jnp.sum(  # noqa: E731
            f(p, q, k, x_v, mask=mask4, deterministic=True) ** 2
        )
    )
    plain = {"params": nn.unbox(params["params"])}
    got = jax.grad(loss(layer.apply), argnums=(0, 1, 2))(plain, x_q, x_k)
    want = jax.grad(loss(ref.apply), argnums=(0, 1, 2))(plain, x_q, x_k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, want)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_full_cross_attention_dropout_and_stats(implementation):
    x_q, x_k, x_v, key_mask = _cross_inputs()
    options = {"implementation": implementation, "query_chunk": 2}
    layer = build_attention(
        "full", options=options, num_heads=H, head_dim=HD, out_dim=D, attention_dropout=0.5
    )
    variables = layer.init(jax.random.key(3), x_q, x_k, x_v, mask=key_mask, deterministic=True)
    params = {"params": variables["params"]}
    kept, state = layer.apply(
        params,
        x_q,
        x_k,
        x_v,
        mask=key_mask,
        deterministic=False,
        rngs={"dropout": jax.random.key(4)},
        mutable=["attention_stats"],
    )
    plain = layer.apply(params, x_q, x_k, x_v, mask=key_mask, deterministic=True)
    assert kept.shape == (B, Q, D) and np.all(np.isfinite(kept))
    assert not np.allclose(kept, plain)
    # Every query counts across two sequences: edges = q x real keys.
    (edges,) = state["attention_stats"]["edges"]
    np.testing.assert_array_equal(edges, np.array(KEY_LENGTHS, np.float32)[:, None] * Q * [1, 1])


@pytest.mark.parametrize("name, options", PARAM_CASES)
def test_cross_attention_runs_exactly_where_listed_and_is_refused_elsewhere(name, options):
    x_q, x_k, x_v, key_mask = _cross_inputs()
    layer = build_attention(name, options=options, num_heads=H, head_dim=HD, out_dim=D)
    rngs = {"params": jax.random.key(1), "sample": jax.random.key(2)}
    if name in CROSS_ATTENTION:
        params = layer.init(rngs, x_q, x_k, x_v, mask=key_mask, deterministic=True)
        assert layer.apply(params, x_q, x_k, mask=key_mask, deterministic=True).shape == (B, Q, D)
        # A mask that varies along the queries is still a pair mask: refused.
        pairs = jnp.ones((B, 1, Q, K), bool).at[:, :, 0, 0].set(False)
        with pytest.raises(ValueError, match="honours only a key-padding mask"):
            layer.apply(params, x_q, x_k, x_v, mask=pairs, deterministic=True)
        with pytest.raises(ValueError, match=r"mask shape \(2, 5\) must equal the keys'"):
            layer.apply(params, x_q, x_k, x_v, mask=key_mask[:, :Q], deterministic=True)
        return
    with pytest.raises(ValueError, match="cross-attention .* supported by full, linear, perf"):
        layer.init(rngs, x_q, x_k, x_v, mask=key_mask, deterministic=True)
    x_q6 = jax.random.normal(jax.random.key(0), (B, K, D))  # same length, other sequence
    with pytest.raises(ValueError, match="cross-attention"):
        layer.init(rngs, x_q6, x_k, mask=key_mask, deterministic=True)


def test_cross_attention_list_names_registered_mechanisms():
    assert set(CROSS_ATTENTION) <= set(available())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_full_cudnn_cross_attention_equals_the_dense_reference():
    x_q, x_k, x_v, key_mask = _cross_inputs()
    options = {"implementation": "cudnn"}
    layer = build_attention(
        "full", options=options, num_heads=H, head_dim=8, out_dim=D, dtype=jnp.bfloat16
    )
    params = layer.init(jax.random.key(1), x_q, x_k, x_v, mask=key_mask, deterministic=True)
    got = layer.apply(params, x_q, x_k, x_v, mask=key_mask, deterministic=True)
    q, k = _project(params, x_q, "query"), _project(params, x_k, "key")
    want = _out(params, softmax_attention(q, k, _project(params, x_v, "value"), key_mask))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)
