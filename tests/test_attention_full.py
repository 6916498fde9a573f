"""Full attention's implementations against a naive dense reference, and their refusals.

``"chunked"`` (query blocks under ``lax.map``, rematerialised in the backward pass) must
be exact softmax attention: outputs and gradients against a float64 numpy forward and a
naive ``jnp`` dense attention written here (every score in one ``[B, H, n, n]`` array),
with padded keys, a block size that does not divide n, bf16 inputs and dropout.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention.full import (
    FullAttention,
    chunked_attention,
    cudnn_attention,
    resolve_implementation,
)

B, N, H, D = 2, 50, 2, 8
CHUNK = 16  # does not divide N: the queries are padded to 64


def inputs(seed: int = 0, n: int = N, d: int = D, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v, g = (jax.random.normal(kk, (B, n, H, d)).astype(dtype) for kk in ks)
    mask = jnp.arange(n)[None, :] < jnp.asarray([[n], [n - 13]])  # example 1 padded
    return q, k, v, g, mask


def numpy_attention(q, k, v, mask) -> np.ndarray:
    """float64 softmax attention over the real keys."""
    q, k, v = (np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in (q, k, v))
    logits = np.einsum("bnhd,bmhd->bhnm", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(np.asarray(mask)[:, None, None, :], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhnm,bmhd->bnhd", w, v)


def naive_attention(q, k, v, mask):
    """Dense jnp softmax attention (all scores at once): the gradient reference."""
    logits = jnp.einsum("bnhd,bmhd->bhnm", q, k) / jnp.sqrt(1.0 * q.shape[-1])
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    return jnp.einsum("bhnm,bmhd->bnhd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("chunk", [CHUNK, 10, 128])  # 128 > N: one block
def test_chunked_matches_dense_reference_outputs_and_gradients(chunk):
    q, k, v, g, mask = inputs()

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * g)

    chunked = lambda q, k, v, m: chunked_attention(q, k, v, m, query_chunk=chunk)
    out = jax.jit(chunked)(q, k, v, mask)
    assert out.shape == (B, N, H, D)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, mask), atol=2e-6, rtol=1e-5)
    got = jax.jit(jax.grad(loss(chunked), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(naive_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # Padded keys get no gradient through k or v.
    assert not np.any(np.asarray(got[1])[1, N - 13 :]) and not np.any(
        np.asarray(got[2])[1, N - 13 :]
    )


def test_chunked_bf16_keeps_scores_in_float32():
    q, k, v, _, mask = inputs(1, n=64, d=64, dtype=jnp.bfloat16)
    q, k = 1.5 * q, 1.5 * k  # logits of std ~2.3, as in test_attention_bf16.py
    out = jax.jit(lambda *a: chunked_attention(*a, query_chunk=24))(q, k, v, mask)
    assert out.dtype == jnp.bfloat16
    ref = numpy_attention(q, k, v, mask)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 3.5e-3  # test_attention_bf16.py's bar: float32 scores measure ~2.3e-3


def module_apply(module, x, mask, **kw):
    params = module.init(jax.random.key(0), x, mask, deterministic=True)
    return params, lambda p, x: module.apply(p, x, mask, **kw)


def test_module_chunked_matches_reference_and_keeps_the_parameter_tree():
    x = jax.random.normal(jax.random.key(2), (B, N, 16))
    mask = inputs()[-1]
    chunked = FullAttention(H, D, 16, implementation="chunked", query_chunk=CHUNK)
    xla = FullAttention(H, D, 16, implementation="xla")
    params, apply = module_apply(chunked, x, mask, deterministic=True)
    assert jax.tree.structure(params) == jax.tree.structure(
        xla.init(jax.random.key(0), x, mask, deterministic=True)
    )
    p = nn.unbox(params["params"])
    proj = lambda name: jnp.einsum("bnc,chd->bnhd", x, p[name]["kernel"]) + p[name]["bias"]
    att = numpy_attention(proj("query"), proj("key"), proj("value"), mask)
    ref = np.einsum("bnhd,hdo->bno", att, p["out"]["kernel"]) + np.asarray(p["out"]["bias"])
    np.testing.assert_allclose(jax.jit(apply)(params, x), ref, atol=2e-5, rtol=1e-4)


def test_chunked_dropout_keeps_one_mask_for_forward_and_backward():
    """With one-hot values (d = n) the output row i is row i of the dropped weights W;
    the gradient for v must then be W^T g: the backward pass regenerated the same mask.
    Every entry of W is 0 or softmax / keep_prob, and about keep_prob of them are kept."""
    n, rate = 40, 0.5
    q, k, _, g, mask = inputs(3, n=n, d=n)
    v = jnp.broadcast_to(jnp.eye(n)[None, :, None, :], (B, n, H, n))
    rng = jax.random.key(7)
    fn = lambda v: chunked_attention(
        q, k, v, mask, query_chunk=16, dropout_rate=rate, dropout_rng=rng
    )
    w = np.asarray(jax.jit(fn)(v))  # [B, n(query), H, n(key)]
    grad_v = jax.jit(jax.grad(lambda v: jnp.sum(fn(v) * g)))(v)
    want = np.einsum("bqhk,bqhd->bkhd", w, np.asarray(g))
    np.testing.assert_allclose(grad_v, want, atol=1e-5, rtol=1e-5)
    soft = numpy_attention(q, k, v, mask)  # undropped weights, the same layout
    kept = w != 0
    np.testing.assert_allclose(w[kept], soft[kept] / (1 - rate), rtol=1e-4)
    real = np.broadcast_to(np.asarray(mask)[:, None, None, :], w.shape)
    assert abs(kept[real].mean() - (1 - rate)) < 0.03
    # The module takes the same path in training.
    module = FullAttention(
        H, 4, 8, attention_dropout=rate, implementation="chunked", query_chunk=16
    )
    x = jax.random.normal(jax.random.key(4), (B, n, 8))
    params = module.init(jax.random.key(0), x, mask, deterministic=True)
    out = module.apply(params, x, mask, deterministic=False, rngs={"dropout": rng})
    assert np.isfinite(np.asarray(out)).all()


def fwd_bwd_temp_bytes(implementation: str, n: int) -> int:
    module = FullAttention(2, 32, 64, implementation=implementation, query_chunk=64)
    x = jnp.zeros((1, n, 64))
    mask = jnp.ones((1, n), bool)
    params = module.init(jax.random.key(0), x[:, :8], mask[:, :8], deterministic=True)

    def loss(p, x, mask):
        return jnp.sum(module.apply(p, x, mask, deterministic=True))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, mask).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_chunked_compiled_temp_memory_is_below_xla():
    """At n=512 XLA's attention holds ``[1, 2, n, n]`` float32 scores and weights for the
    backward pass (2 MiB each); 64-query blocks hold an eighth of that at a time."""
    chunked, xla = fwd_bwd_temp_bytes("chunked", 512), fwd_bwd_temp_bytes("xla", 512)
    assert xla > 2 * 512 * 512 * 4  # the dense scores are there
    assert chunked < 0.4 * xla, (chunked, xla)


def test_auto_picks_cudnn_on_gpu_in_half_precision_chunked_for_long_inputs():
    kw = dict(head_dim=32, query_chunk=512, dropout=False)
    assert (
        resolve_implementation("auto", length=4096, dtype=jnp.bfloat16, backend="gpu", **kw)
        == "cudnn"
    )
    assert (
        resolve_implementation("auto", length=4096, dtype=jnp.float16, backend="gpu", **kw)
        == "cudnn"
    )
    assert (
        resolve_implementation("auto", length=4096, dtype=jnp.float32, backend="gpu", **kw)
        == "chunked"
    )
    assert (
        resolve_implementation("auto", length=4096, dtype=jnp.bfloat16, backend="cpu", **kw)
        == "chunked"
    )
    assert (
        resolve_implementation("auto", length=512, dtype=jnp.float32, backend="tpu", **kw) == "xla"
    )
    kw["dropout"] = True  # cuDNN has no attention dropout here
    assert (
        resolve_implementation("auto", length=4096, dtype=jnp.bfloat16, backend="gpu", **kw)
        == "chunked"
    )
    kw.update(dropout=False, head_dim=12)  # a width cuDNN's flash kernels do not take
    assert (
        resolve_implementation("auto", length=4096, dtype=jnp.bfloat16, backend="gpu", **kw)
        == "chunked"
    )
    assert (
        resolve_implementation("xla", length=4096, dtype=jnp.bfloat16, backend="gpu", **kw) == "xla"
    )


def test_cudnn_is_refused_off_gpu_and_in_float32(monkeypatch):
    module = FullAttention(H, D, 16, implementation="cudnn", dtype=jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"^model.attention_options.implementation='cudnn' needs an NVIDIA GPU, "
        "but the backend is 'cpu'",
    ):
        module.validate()
    x, mask = jnp.zeros((B, N, 16), jnp.bfloat16), inputs()[-1]
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):  # before anything is traced
        module.init(jax.random.key(0), x, mask, deterministic=True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    module.validate()  # bf16 on a GPU is accepted
    with pytest.raises(
        ValueError,
        match=r"takes only a bfloat16 or float16 compute dtype \(model.dtype\), got float32",
    ):
        FullAttention(H, D, 16, implementation="cudnn").validate()
    with pytest.raises(ValueError, match="has no attention dropout"):
        FullAttention(
            H, D, 16, implementation="cudnn", dtype=jnp.float16, attention_dropout=0.1
        ).validate()


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("implementation", "cudnn", "implementation='cudnn' needs an NVIDIA GPU"),
        (
            "implementation",
            "flash",
            "implementation must be one of ('auto', 'xla', 'chunked', 'cudnn'), got 'flash'",
        ),
        ("query_chunk", -1, "query_chunk must be an int >= 0, got -1"),
    ],
)
def test_config_check_refuses_bad_full_options_on_one_line(option, value, message):
    from configs import synthetic as synthetic_config
    from sbm_jax.training.config_checks import config_errors

    config = synthetic_config.get_config("full,smoke")
    config.model.attention_options[option] = value
    errors = [e for e in config_errors(config) if "attention" in e]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"model.attention_options.{option}"), errors
    assert message in errors[0], errors


def test_config_check_passes_model_dtype_to_validate(monkeypatch):
    """The config check builds the layer with model.dtype, as the encoder does: float32
    with cuDNN is refused by the dtype, bfloat16 accepted (here posing as a GPU host)."""
    from configs import synthetic as synthetic_config
    from sbm_jax.training.config_checks import config_errors

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    config = synthetic_config.get_config("full,smoke")
    config.model.attention_options.implementation = "cudnn"
    (error,) = [e for e in config_errors(config) if "attention" in e]
    assert "got float32" in error
    config.model.dtype = "bfloat16"
    assert not [e for e in config_errors(config) if "attention" in e]


def test_cudnn_lowers_for_cuda():
    """Lower cuDNN attention's fwd+bwd for CUDA from this host, where JAX can (it needs
    the CUDA plugin's cuDNN version even to lower)."""
    q = jax.ShapeDtypeStruct((2, 256, 2, 32), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, 256), jnp.bool_)

    def loss(q, k, v, mask):
        return jnp.sum(cudnn_attention(q, k, v, mask).astype(jnp.float32))

    try:
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q, mask)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as err:
        if "cuDNN is not detected" in str(err):
            pytest.skip("this JAX has no CUDA plugin: cuDNN attention cannot be lowered here")
        raise
    assert "cudnn" in text.lower()
