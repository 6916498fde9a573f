"""recompute_after_cotangent and its Linen form call_recomputed_after_cotangent: the same
values and gradients as the function or module they wrap, and a recomputation that really
waits for the backward pass (sbm_jax/_remat.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sbm_jax._remat import call_recomputed_after_cotangent, recompute_after_cotangent

N, D, W, LAYERS = 256, 64, 4096, 4


def _layer(x, a, b):
    return jnp.tanh(jnp.sin(x @ a) @ b)  # an [N, W] intermediate, 4x the input


def _stack_case():
    ks = jax.random.split(jax.random.PRNGKey(0), 2 * LAYERS + 2)
    ws = [
        (jax.random.normal(ks[2 * i], (D, W)) / 8, jax.random.normal(ks[2 * i + 1], (W, D)) / 64)
        for i in range(LAYERS)
    ]
    return ws, jax.random.normal(ks[-2], (N, D)), jax.random.normal(ks[-1], (N, D))


def _stack_loss(layer):
    def loss(ws, x, g):
        for a, b in ws:
            x = x + layer(x, a, b)
        return jnp.sum(jnp.cos(x) * g)  # a cotangent that depends on the forward pass

    return loss


def test_values_and_gradients_are_those_of_the_plain_function():
    # Against plain autodiff of the unwrapped function (no checkpoint, no custom VJP),
    # with an integer output, a key input and a tuple of outputs in the pytree.
    def fn(x, a, key, n):
        noise = jax.random.normal(key, (x.shape[0], a.shape[1]))
        h = jnp.sin(x @ a) * (1.0 + 0.1 * noise)
        return {"y": jnp.tanh(h) * n, "count": jnp.sum(h > 0).astype(jnp.int32)}, (h.mean(),)

    wrapped = recompute_after_cotangent(jax.checkpoint(fn), gate_size=D * 8)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
    a = jax.random.normal(jax.random.PRNGKey(2), (D, 8))
    key = jax.random.key(3)

    def loss(f):
        def run(x, a, n):
            (out, (m,)) = f(x, a, key, n)
            return jnp.sum(out["y"] ** 2) + 3.0 * m, out["count"]

        return run

    (value, count), (want_value, want_count) = (jax.jit(loss(f))(x, a, 2.0) for f in (wrapped, fn))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    assert count == want_count
    got = jax.jit(jax.grad(loss(wrapped), argnums=(0, 1, 2), has_aux=True))(x, a, 2.0)
    want = jax.grad(loss(fn), argnums=(0, 1, 2), has_aux=True)(x, a, 2.0)
    for g, w in zip(got[0], want[0], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])


def test_a_stack_holds_one_layers_intermediate_not_every_layers():
    # Four checkpointed layers whose [N, W] intermediate is recomputed in the backward
    # pass: the compiled step should hold about one layer's (its recomputation and its
    # cotangent), not one per layer kept from the forward pass, which is what XLA:CPU
    # gives jax.checkpoint alone (9 intermediates here: it merges the recomputation with
    # the forward computation). Compile-time memory analysis: nothing runs or is timed.
    ws, x, g = _stack_case()
    layer = recompute_after_cotangent(jax.checkpoint(_layer), gate_size=D * W)
    grad = jax.jit(jax.grad(_stack_loss(layer), argnums=(0, 1)))
    temp = grad.lower(ws, x, g).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 4 * N * W * 4, temp / (N * W * 4)
    want = jax.grad(_stack_loss(_layer), argnums=(0, 1))(ws, x, g)
    got = grad(ws, x, g)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


class _Block(nn.Module):
    """A residual block with dropout and a sown value, like the encoder's."""

    rate: float

    @nn.compact
    def __call__(self, x, mask, deterministic):
        h = jnp.sin(nn.Dense(W, name="up")(x))  # an [N, W] intermediate
        h = nn.Dropout(self.rate)(h, deterministic=deterministic)
        self.sow("stats", "mean", jnp.mean(h))
        return x + jnp.where(mask[:, None], nn.Dense(D, name="down")(h) / 64, 0.0)


class _Stack(nn.Module):
    gated: bool
    rate: float = 0.25

    @nn.compact
    def __call__(self, x, mask):
        for i in range(LAYERS):
            block = nn.remat(_Block, static_argnums=(3,))(self.rate, name=f"block_{i}")
            if self.gated:
                x = call_recomputed_after_cotangent(
                    lambda mdl, x, mask: mdl(x, mask, False), block, x, mask
                )
            else:
                x = block(x, mask, False)
        return x


def _module_loss(model, x, g, mask):
    def loss(params):
        out, stats = model.apply(
            {"params": params},
            x,
            mask,
            rngs={"dropout": jax.random.PRNGKey(5)},
            mutable=["stats"],
        )
        return jnp.sum(jnp.cos(out) * g), stats

    return loss


def test_the_linen_form_keeps_values_gradients_dropout_and_sown_stats():
    # Against the same stack under plain nn.remat: the same loss, gradients, sown values
    # and dropout masks (the same 'dropout' stream), and the same parameter tree at init.
    _, x, g = _stack_case()
    mask = jnp.arange(N) < N - 7
    plain, gated = _Stack(gated=False), _Stack(gated=True)
    params = plain.init(jax.random.PRNGKey(0), x, mask)["params"]
    params_gated = gated.init(jax.random.PRNGKey(0), x, mask)["params"]
    jax.tree.map(np.testing.assert_array_equal, params, params_gated)
    (want, want_stats), want_grads = jax.value_and_grad(
        _module_loss(plain, x, g, mask), has_aux=True
    )(params)
    (got, got_stats), got_grads = jax.jit(
        jax.value_and_grad(_module_loss(gated, x, g, mask), has_aux=True)
    )(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got_stats, want_stats)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_grads, want_grads
    )


def test_the_linen_form_holds_one_blocks_intermediate_not_every_blocks():
    # The Linen stack's compiled step under the gated call: about one block's [N, W]
    # intermediate (3 here), where plain nn.remat on XLA:CPU holds one per block (9: the
    # same limit as jax.checkpoint, the barrier is expanded). Without dropout: with it,
    # XLA:CPU also starts every block's forward random-bit counters at the top of the
    # step (an [N, W] array per block, gated or not; docs/log.md).
    _, x, g = _stack_case()
    mask = jnp.ones((N,), bool)
    model = _Stack(gated=True, rate=0.0)
    params = model.init(jax.random.PRNGKey(0), x, mask)["params"]
    grad = jax.jit(jax.grad(_module_loss(model, x, g, mask), has_aux=True))
    temp = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 4 * N * W * 4, temp / (N * W * 4)
