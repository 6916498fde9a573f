"""scripts/synthetic_drive.py: the density-drive figures of docs/synthetic.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


@pytest.mark.slow  # suite time: the first-order check above stays in the default run
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


@pytest.mark.slow  # suite time: the first-order check above stays in the default run
def test_run_mode_measures_the_update_the_trainer_then_applied(tmp_path):
    # A smoke run keeping a checkpoint per step: the drive of "the next update" at step s
    # must be <params_{s+1} - params_s, g_rho>, with params_{s+1} the trainer's own next
    # checkpoint (same batch, graph, Adam state, schedule); the parts add up to it.
    from configs import synthetic as synthetic_config
    from sbm_jax.tasks import build_task
    from sbm_jax.training.checkpoints import restore_snapshot
    from sbm_jax.training.trainer import train_and_evaluate

    drive = load_script("synthetic_drive")
    config = synthetic_config.get_config("sbm,smoke")
    config.train.num_steps = 3
    config.train.warmup_steps = 0
    config.checkpoint.every_steps = 1
    config.checkpoint.max_to_keep = 10
    run = str(tmp_path / "run")
    train_and_evaluate(config, build_task(config), output_dir=run)
    steps = drive.run_steps(run)
    assert steps[:3] == [1, 2, 3], steps

    rows = drive.measure_run(run, 1)
    assert [r["step"] for r in rows] == steps
    assert [r["step"] for r in drive.measure_run(run, 1, drive.step_range("2:2"))] == [2]
    assert drive.step_range("700:") == (700, 2**62) and drive.step_range(":5") == (0, 5)
    with pytest.raises(ValueError, match="FIRST:LAST"):
        drive.step_range("700")
    for r in rows:
        parts = r["graph"] + r["qk"] + r["rest"]
        np.testing.assert_allclose(parts, r["total"], rtol=1e-6, atol=1e-12)
        assert 0.0 < r["density"] <= 1.0

    # Independently: the step the trainer took from step 1 to step 2.
    task = build_task(config)
    state0, _, batches = drive.setup("smoke", config.model.query_key_init, config.seed)
    folder = str(tmp_path / "run" / "checkpoints" / "latest")
    s1, _ = restore_snapshot(folder, state0, step=1)
    s2, _ = restore_snapshot(folder, state0, step=2)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 99 .* it has \[1, 2, 3"):
        restore_snapshot(folder, state0, step=99)
    g_loss, g_rho, _ = drive.density_grads_fn(task)(s1, next(task.train_batches(1)), 1)
    taken = jax.tree.map(jnp.subtract, s2.params, s1.params)
    want = sum(
        float(jnp.vdot(a, b))
        for a, b in zip(jax.tree.leaves(taken), jax.tree.leaves(g_rho), strict=True)
    )
    got = drive.update_drives(s1, g_loss, g_rho)
    assert want != 0.0
    np.testing.assert_allclose(got["total"], want, rtol=1e-3)
    np.testing.assert_allclose(rows[0]["total"], got["total"], rtol=1e-5)
