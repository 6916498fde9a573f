"""Tensorized Spectral Attention and the paper's classifier against naive numpy references."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sbm_jax.attention.registry import STATS_COLLECTION, build_attention
from sbm_jax.attention.tsa import TensorizedSpectralAttention, time_graph
from sbm_jax.models.tsa_classifier import TSAClassifier
from tests.attention_testing import assert_traced_once, masked_grads_are_finite, tt_dense_by_loops

B, L, D, H, DH = 2, 6, 8, 2, 4


def numpy_weights(params: dict, projection: str):
    """Per-head key/value weights [H][D, DH] and the output weight [H*DH, D] as numpy."""

    def per_head(p):
        if projection == "dense":
            k = np.asarray(p["kernel"], np.float64)  # [D, H, DH]
            return [k[:, h, :] for h in range(k.shape[1])]
        n = sum(1 for name in p if name.startswith("core_"))
        heads = p["core_0"].shape[0]
        return [tt_dense_by_loops([p[f"core_{i}"][h] for i in range(n)]) for h in range(heads)]

    def single(p):
        if projection == "dense":
            return np.asarray(p["kernel"], np.float64)
        n = sum(1 for name in p if name.startswith("core_"))
        return tt_dense_by_loops([p[f"core_{i}"] for i in range(n)])

    return per_head(params["key"]), per_head(params["value"]), single(params["out"])


def numpy_tsa(x: np.ndarray, wk, wv, wo, damping: float) -> np.ndarray:
    """Naive TSA on ONE unpadded sequence x [n, D]: explicit Omega, Theta, Psi per head."""
    n = x.shape[0]
    a = np.zeros((n, n))
    for l1 in range(n):
        for l2 in range(n):
            if l2 > l1:
                a[l1, l2] = damping ** (l2 - l1)
    omega = 0.5 * (a + a.T)
    heads = []
    for h in range(len(wk)):
        k = x @ wk[h]
        v = x @ wv[h]
        theta = np.zeros((n, n))
        for l1 in range(n):
            for l2 in range(n):
                if l1 != l2:
                    theta[l1, l2] = max(0.0, k[l1] @ k[l2] / np.sqrt(k.shape[1]))
        psi = omega * theta
        heads.append((np.eye(n) + psi) @ v)
    return np.concatenate(heads, axis=-1) @ wo


def make_inputs(seed: int = 0, lengths=(L, 4)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    mask = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
    return x, mask


def random_params(module, *inputs, seed: int = 0, scale: float = 0.5):
    """Parameters of the module's shapes, filled from numpy (shapes via eval_shape, no compile)."""
    shapes = jax.eval_shape(
        lambda: nn.unbox(module.init(jax.random.key(0), *inputs, deterministic=True))["params"]
    )
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), jnp.float32), shapes
    )


def jit_apply(module, deterministic: bool = True):
    """Jitted ``(params, x, mask[, dropout_key]) -> output`` (one compile, not op by op)."""
    if deterministic:
        return jax.jit(lambda p, x, m: module.apply({"params": p}, x, m, deterministic=True))
    return jax.jit(
        lambda p, x, m, key: module.apply(
            {"params": p}, x, m, deterministic=False, rngs={"dropout": key}
        )
    )


def init_tsa(projection: str, damping: float = 0.8, **kw):
    module = TensorizedSpectralAttention(
        num_heads=H, head_dim=DH, out_dim=D, damping=damping, projection=projection, **kw
    )
    x, mask = make_inputs()
    return module, random_params(module, jnp.asarray(x), jnp.asarray(mask))


def test_time_graph_matches_paper_formula():
    c, n = 0.7, 5
    omega = np.asarray(time_graph(n, c))
    for l1 in range(n):
        for l2 in range(n):
            expected = 0.0 if l1 == l2 else 0.5 * c ** abs(l1 - l2)
            assert omega[l1, l2] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("projection", ["tt", "dense"])
def test_tsa_matches_numpy_reference(projection):
    module, params = init_tsa(projection)
    x, mask = make_inputs(1)
    y = jit_apply(module)(params, jnp.asarray(x), jnp.asarray(mask))
    assert y.shape == (B, L, D)
    wk, wv, wo = numpy_weights(params, projection)
    for b in range(B):
        n = int(mask[b].sum())
        # The reference sees only the real tokens, so this also checks the padding semantics.
        expected = numpy_tsa(x[b, :n].astype(np.float64), wk, wv, wo, damping=0.8)
        np.testing.assert_allclose(np.asarray(y[b, :n]), expected, rtol=1e-4, atol=1e-4)


def test_tsa_with_bias_matches_reference():
    module, params = init_tsa("dense", use_bias=True)
    x, mask = make_inputs(3, lengths=(L, L))
    y = jit_apply(module)(params, jnp.asarray(x), jnp.asarray(mask))
    bk, bv, bo = (np.asarray(params[n]["bias"], np.float64) for n in ("key", "value", "out"))
    wk, wv, wo = numpy_weights(params, "dense")
    # Fold the biases into the reference with an appended constant-1 feature.
    x1 = np.concatenate([x.astype(np.float64), np.ones((B, L, 1))], axis=-1)
    wk1 = [np.vstack([wk[h], bk[h]]) for h in range(H)]
    wv1 = [np.vstack([wv[h], bv[h]]) for h in range(H)]
    for b in range(B):
        expected = numpy_tsa(x1[b], wk1, wv1, wo, damping=0.8) + bo
        np.testing.assert_allclose(np.asarray(y[b]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("projection", ["tt", "dense"])
def test_padding_never_influences_real_tokens(projection):
    module, params = init_tsa(projection)
    x, _ = make_inputs(4)
    mask = np.array(
        [[True, False, True, True, False, True], [True, True, True, False, False, False]]
    )
    noisy = x.copy()
    noisy[~mask] = 100.0 * np.random.default_rng(5).standard_normal(noisy[~mask].shape)

    run = jit_apply(module)
    y = run(params, jnp.asarray(x), jnp.asarray(mask))
    y_noisy = run(params, jnp.asarray(noisy), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(y)[mask], np.asarray(y_noisy)[mask])


def test_no_retracing_across_batches():
    module, params = init_tsa("tt")

    def fwd(params, x, mask):
        return module.apply({"params": params}, x, mask, deterministic=True)

    def calls():
        for seed, lengths in [(0, (6, 4)), (1, (2, 5)), (2, (6, 6))]:
            x, mask = make_inputs(seed, lengths)
            yield params, jnp.asarray(x), jnp.asarray(mask)

    assert_traced_once(fwd, calls())


def test_gradients_finite_including_empty_sequence():
    module, params = init_tsa("tt")
    x, mask = make_inputs(6, lengths=(3, 0))

    def apply(params, x):
        return module.apply({"params": params}, x, jnp.asarray(mask), deterministic=True)

    g_params, g_x = masked_grads_are_finite(apply, params, jnp.asarray(x), jnp.asarray(mask))
    leaves = jax.tree.leaves(g_params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
    assert bool(jnp.all(jnp.isfinite(g_x)))
    assert float(jnp.max(jnp.abs(g_x[~mask]))) == 0.0  # padded inputs do not reach the loss


def test_bfloat16_close_to_float32():
    module32, params = init_tsa("tt")
    module16 = module32.clone(dtype=jnp.bfloat16)
    x, mask = make_inputs(9)
    args = (params, jnp.asarray(x), jnp.asarray(mask))
    y32 = np.asarray(jit_apply(module32)(*args))
    y16 = jit_apply(module16)(*args)
    assert y16.dtype == jnp.bfloat16
    scale = np.max(np.abs(y32))
    # A few times the measured error (0.0069 of the scale on these inputs).
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.02 * scale)


def test_density_stats_match_numpy_count():
    module, params = init_tsa("dense")
    x, mask = make_inputs(7)
    stats = jax.jit(
        lambda p, x, m: module.apply(
            {"params": p}, x, m, deterministic=True, mutable=[STATS_COLLECTION]
        )[1]
    )
    state = stats(params, jnp.asarray(x), jnp.asarray(mask))
    density = np.asarray(state[STATS_COLLECTION]["density"][0])
    edges = np.asarray(state[STATS_COLLECTION]["edges"][0])
    wk, _, _ = numpy_weights(params, "dense")
    for b in range(B):
        n = int(mask[b].sum())
        for h in range(H):
            k = x[b, :n].astype(np.float64) @ wk[h]
            s = k @ k.T
            count = sum(s[i, j] > 0 for i in range(n) for j in range(n) if i != j)
            assert edges[b, h] == count
            assert density[b, h] == pytest.approx(count / (n * (n - 1)), rel=1e-6)


def test_attention_dropout_uses_dropout_rng_only_when_training():
    module, params = init_tsa("tt", attention_dropout=0.5)
    x, mask = make_inputs(8)
    args = (params, jnp.asarray(x), jnp.asarray(mask))
    ref_module, _ = init_tsa("tt")
    y_eval = jit_apply(module)(*args)
    np.testing.assert_allclose(
        np.asarray(y_eval), np.asarray(jit_apply(ref_module)(*args)), rtol=1e-6
    )
    train = jit_apply(module, deterministic=False)
    y1 = train(*args, jax.random.key(1))
    y2 = train(*args, jax.random.key(2))
    assert not np.allclose(np.asarray(y1), np.asarray(y2))
    # Dropout acts on Psi's edges only, so padded tokens still cannot reach real ones.
    noisy = x.copy()
    noisy[~mask] = 50.0
    y3 = train(params, jnp.asarray(noisy), jnp.asarray(mask), jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(y1)[mask], np.asarray(y3)[mask])


def test_registry_builds_tsa_and_rejects_bad_options():
    fields = dict(num_heads=H, head_dim=DH, out_dim=D)
    module = build_attention("tsa", options={"damping": 0.5, "projection": "dense"}, **fields)
    assert isinstance(module, TensorizedSpectralAttention)
    x, mask = make_inputs()
    with pytest.raises(ValueError, match="model.attention_options.damping"):
        build_attention("tsa", options={"damping": 1.0}, **fields).init(
            jax.random.key(0), jnp.asarray(x), jnp.asarray(mask), deterministic=True
        )

    with pytest.raises(ValueError, match="model.attention_options.projection"):
        build_attention("tsa", options={"projection": "cp"}, **fields).init(
            jax.random.key(0), jnp.asarray(x), jnp.asarray(mask), deterministic=True
        )

    with pytest.raises(ValueError, match="model.attention_options.window"):
        build_attention("tsa", options={"window": 3}, **fields)


def test_classifier_shapes_and_padding():
    model = TSAClassifier(vocab_size=50, num_classes=3, embed_dim=8, num_heads=2, head_dim=4)
    tokens = np.random.default_rng(0).integers(1, 50, size=(4, 7))
    mask = np.arange(7)[None, :] < np.array([[7], [5], [3], [1]])
    params = random_params(model, tokens, mask)
    run = jit_apply(model)
    logits = run(params, tokens, mask)
    assert logits.shape == (4, 3)
    other = np.where(mask, tokens, 0)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(run(params, other, mask)))
    # The paper's sizes: H = 2 heads, 20 hidden units, TT projections.
    assert params["hidden"]["kernel"].shape == (8, 20)
    assert "core_0" in params["tsa"]["key"]


def test_classifier_loss_decreases():
    model = TSAClassifier(vocab_size=30, num_classes=2, embed_dim=8, num_heads=2, head_dim=4)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(1, 30, size=(8, 6)))
    mask = jnp.asarray(np.arange(6)[None, :] < rng.integers(2, 7, size=(8, 1)))
    labels = jnp.asarray(rng.integers(0, 2, size=8))
    params = random_params(model, tokens, mask, scale=0.3)
    tx = optax.adam(3e-2)
    opt_state = tx.init(params)

    def loss_fn(params, key):
        logits = model.apply(
            {"params": params}, tokens, mask, deterministic=False, rngs={"dropout": key}
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def step(params, opt_state, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_loss(params):
        logits = model.apply({"params": params}, tokens, mask, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    initial = float(eval_loss(params))
    for i in range(30):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        assert np.isfinite(float(loss))
    final = float(eval_loss(params))
    assert final < 0.5 * initial, (initial, final)
