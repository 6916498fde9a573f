"""scripts/synthetic_drive.py: the density-drive figures of docs/synthetic.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.scripts_testing import load_script


def test_drives_are_the_first_order_density_change_of_each_step():
    drive = load_script("synthetic_drive")
    g_loss = {"a": jnp.asarray([1.0, -2.0]), "b": {"c": jnp.asarray([[0.5]])}}
    g_rho = {"a": jnp.asarray([3.0, 1.0]), "b": {"c": jnp.asarray([[-4.0]])}}
    sgd, adam = drive.drives(g_loss, g_rho)
    # -(1*3 + -2*1 + 0.5*-4) = 1 ;  -(3 - 1 - 4) = 2
    np.testing.assert_allclose([sgd, adam], [1.0, 2.0])
    # Restricted to the leaves under "b": -(0.5*-4) = 2 ; -(1*-4) = 4
    np.testing.assert_allclose(drive.drives(g_loss, g_rho, only=("'b'",)), [2.0, 4.0])


def test_density_gradient_is_that_of_the_sown_density_on_the_same_graph():
    from sbm_jax.attention import STATS_COLLECTION
    from sbm_jax.training.stats import collect_attention_stats
    from sbm_jax.training.steps import step_rngs

    drive = load_script("synthetic_drive")
    state, task, batches = drive.setup("smoke", "independent", 0)
    batch = next(batches)
    g_loss, g_rho, rho = drive.density_grads_fn(task)(state, batch, 3)

    rngs = step_rngs(state.rng, jnp.asarray(3))

    def density(params):
        _, mutables = state.apply_fn(
            {"params": params},
            **task.model_inputs(batch),
            deterministic=False,
            rngs=rngs,
            mutable=[STATS_COLLECTION],
        )
        return collect_attention_stats(mutables)["density"]

    value, direct = jax.value_and_grad(density)(state.params)
    np.testing.assert_allclose(rho, float(value), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(g_rho), jax.tree.leaves(direct), strict=True):
        # g_rho is a difference of two gradients: float32 rounding of g_L (~1e-7) stays.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    # The density moves the SBM's clusters and membership MLP (and, through the
    # memberships, queries, keys and what feeds them), never the values ...
    moved = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(g_rho)
        if float(jnp.max(jnp.abs(leaf))) > 0
    }
    assert any("clusters" in p for p in moved) and any("mlp_w1" in p for p in moved), moved
    assert not any("['value']" in p for p in moved), moved
    # ... and the task loss reaches them too (through eq. 9), so the drive is defined.
    sgd, adam = drive.drives(g_loss, g_rho)
    assert np.isfinite(sgd) and np.isfinite(adam) and sgd != 0.0
