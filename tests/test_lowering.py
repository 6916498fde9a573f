"""Every path of the SBM layer, and the ``full`` mechanism, lowers for ``cuda`` and ``tpu``.

Lowering (``jax.jit(f).trace(*args).lower(lowering_platforms=(...,))``) runs on this
CPU without a device: it turns the traced program, Pallas kernels included (the
``triton`` kernel's Triton IR), into the platform's StableHLO, so that no device time is
ever spent on a lowering error. Each case lowers the forward and the backward pass
(``value_and_grad``) at toy sizes, traced as the layer traces itself on that backend:
``jax.default_backend()`` reads ``"gpu"`` or ``"tpu"`` during the trace, so the
accelerator's head mapping (one ``vmap`` over the graphs) and fastRG's loop-free CDFs
are what is lowered. Compiling for the device (Triton to PTX, XLA's GPU/TPU passes) is
left to the device: ``scripts/accelerator_check.py``, which also covers cuDNN flash
attention (``implementation="cudnn"`` asks for the cuDNN version while tracing, so it
cannot be lowered without a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbm_jax.attention.sbm import sbm_attention_core
from sbm_jax.kernels.cost import resolve_kernel

B, H, L, KC, D = 1, 2, 32, 4, 8
PLATFORMS = {"cuda": "gpu", "tpu": "tpu"}


@pytest.fixture
def as_backend(monkeypatch):
    def set_backend(name):
        monkeypatch.setattr(jax, "default_backend", lambda: name)

    return set_backend


def _args():
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = f32(B, H, L, D), f32(B, H, L, D), f32(B, H, L, D)
    qm = jnp.asarray(rng.random((B, H, L, KC)) * 0.3, jnp.float32)
    km = jnp.asarray(rng.random((B, H, L, KC)) * 0.3, jnp.float32)
    blk = jnp.asarray(rng.random((H, KC, KC)) / KC, jnp.float32)
    return q, k, v, qm, blk, km


def _lower_core(platform, *, impl, kernel, ste, dtype=jnp.float32, dropout=0.0):
    mask = jnp.arange(L)[None, :] < jnp.array([[L - 5]])

    def loss(q, k, v, qm, blk, km):
        out, st = sbm_attention_core(
            jax.random.PRNGKey(0),
            q.astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            qm,
            blk,
            km,
            mask,
            delta=0.02,
            capacity_buckets=(0.25,),
            impl=impl,
            kernel=kernel,
            window=2,
            max_dense_elements=2**31 if impl == "dense" else 1,
            ste=ste,
            dropout_rate=dropout,
            dropout_rng=jax.random.PRNGKey(1) if dropout else None,
        )
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(st["density"])

    fn = jax.jit(jax.value_and_grad(loss, argnums=range(6)))
    return fn.trace(*_args()).lower(lowering_platforms=(platform,)).as_text()


# Each kernel with the paper's estimator; each estimator with the default kernel and on
# the dense path; dropout and bf16 once each. The triton kernel is GPU-only (below).
CASES = [
    ("sparse", "rows", "paper", "f32", 0.0),
    ("sparse", "segment", "paper", "f32", 0.0),
    ("sparse", "rows", "reference", "f32", 0.1),
    ("sparse", "rows", "pairs", "f32", 0.0),
    ("dense", "rows", "paper", "f32", 0.0),
    ("dense", "rows", "reference", "f32", 0.0),
    ("dense", "rows", "pairs", "bf16", 0.1),
]


def _case_id(c):
    return "-".join(str(x) for x in c)


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize("impl,kernel,ste,dtype,dropout", CASES, ids=map(_case_id, CASES))
def test_sbm_core_lowers(as_backend, platform, impl, kernel, ste, dtype, dropout):
    as_backend(PLATFORMS[platform])
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    text = _lower_core(platform, impl=impl, kernel=kernel, ste=ste, dtype=dt, dropout=dropout)
    assert "func.func public @main" in text


@pytest.mark.parametrize("ste", ["paper", "reference", "pairs"])
def test_triton_kernel_lowers_for_cuda(as_backend, ste):
    # The Pallas kernels (forward and backward) lower to Triton custom calls.
    as_backend("gpu")
    text = _lower_core("cuda", impl="sparse", kernel="triton", ste=ste, dropout=0.1)
    assert text.count("triton") >= 2, "forward and backward Triton kernels"


def test_triton_kernel_is_refused_for_tpu(as_backend):
    as_backend("tpu")
    with pytest.raises(ValueError, match="kernel='triton' needs an NVIDIA GPU.*'tpu'"):
        _lower_core("tpu", impl="sparse", kernel="triton", ste="paper")
    assert resolve_kernel("auto", "tpu") == "rows"


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_full_mechanism_lowers(as_backend, platform):
    from sbm_jax.attention.full import FullAttention

    as_backend(PLATFORMS[platform])
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, L, 16)), jnp.float32)
    mask = jnp.arange(L)[None, :] < L - 3
    layer = FullAttention(num_heads=H, head_dim=D, out_dim=16, attention_dropout=0.1)
    params = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), x, mask, deterministic=True))

    def loss(params, x):
        out = layer.apply(
            params, x, mask, deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)}
        )
        return jnp.sum(out)

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    text = jax.jit(jax.grad(loss)).trace(zeros, x).lower(lowering_platforms=(platform,)).as_text()
    assert "func.func public @main" in text
