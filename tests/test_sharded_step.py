"""The trainer's step: 8 sharded CPU devices vs one device, accumulation vs one pass,
and the shared loop's step as the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sbm_jax.training.config_checks import ConfigError
from sbm_jax.training.trainer import accumulation_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from configs.lra import listops
    from lra.train_task import MockSource, train_dataset
    from sbm_jax.models import build_model
    from sbm_jax.training.state import create_train_state, learning_rate_schedule
    from sbm_jax.training.steps import make_mesh, make_train_step, replicated, shard_batch
    from sbm_jax.training.task import Task
    from sbm_jax.training.trainer import (
        make_accumulating_train_step, micro_batch_sharding, split_micro_batches)

    assert jax.device_count() == 8, jax.devices()
    out = {}
    for mech in MECHANISMS:
        config = listops.get_config(mech + ",smoke")
        config.train.batch_size = 16
        src = MockSource("listops", "train", 64, 32, 0)
        batch = train_dataset(src, "listops", 16, 32, 0)[0]
        task = Task(name="t", head="classification", train_batches=None)
        model = build_model(config.model, "classification")
        schedule = learning_rate_schedule(config.train)

        def run(mesh, accum, reference=False):
            state = create_train_state(config, model, task, batch)
            state = jax.device_put(state, replicated(mesh))
            if reference:
                step = make_train_step(task, mesh, 0.1, schedule)
                new, m = step(state, shard_batch(batch, mesh))
            else:
                step = make_accumulating_train_step(task, mesh, 0.1, accum, schedule)
                b = jax.device_put(split_micro_batches(batch, accum), micro_batch_sharding(mesh))
                new, m = step(state, b)
            return jax.device_get((new.params, m["loss"], m.get("density", 0.0)))

        one = run(make_mesh(1), 1)
        ref = run(make_mesh(1), 1, reference=True)
        eight = run(make_mesh(8), 1)
        res = {}
        for name, other in (("eight", eight), ("reference", ref)):
            res[name] = {
                "loss": abs(float(one[1]) - float(other[1])),
                "density": abs(float(one[2]) - float(other[2])),
                "params": max(float(np.max(np.abs(a - b))) for a, b in zip(
                    jax.tree.leaves(one[0]), jax.tree.leaves(other[0]))),
            }
        if mech == "full":  # no sampling: micro-batches see the same function
            acc = run(make_mesh(8), 2)
            res["accum2_eight"] = {
                "loss": abs(float(one[1]) - float(acc[1])),
                "params": max(float(np.max(np.abs(a - b))) for a, b in zip(
                    jax.tree.leaves(one[0]), jax.tree.leaves(acc[0]))),
            }
        res["param_scale"] = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(one[0]))
        out[mech] = res
    print("RESULT" + json.dumps(out))
    """
)


def test_accumulation_steps_closed_form():
    assert accumulation_steps(128, 8, 0) == 1
    assert accumulation_steps(128, 8, 16) == 1
    assert accumulation_steps(128, 8, 8) == 2
    assert accumulation_steps(1024, 1, 100) == 16  # 64 per pass
    assert accumulation_steps(96, 1, 40) == 3
    assert accumulation_steps(14, 1, 4) == 7  # divisors of 14: 7 passes of 2
    with pytest.raises(ConfigError, match="train.max_per_device_batch"):
        accumulation_steps(16, 1, -1)
    with pytest.raises(ConfigError, match="train.batch_size"):
        accumulation_steps(10, 4, 0)


@pytest.mark.parametrize("mechanism", ["sbm", pytest.param("full", marks=pytest.mark.slow)])
def test_sharded_step_matches_single_device_and_reference(mechanism):
    """One step on 8 devices == one step on 1 device == the shared loop's step; for full
    attention also 2 accumulated micro-batches on 8 devices == one pass."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", f"MECHANISMS = ({mechanism!r},)\n" + SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    result = json.loads(line[len("RESULT") :])
    for mech, res in result.items():
        for name in ("eight", "reference"):
            assert res[name]["loss"] < 1e-5, (mech, name, res)
            assert res[name]["density"] < 1e-5, (mech, name, res)
            assert res[name]["params"] < 1e-5 * max(res["param_scale"], 1.0), (mech, name, res)
    if mechanism == "full":
        acc = result["full"]["accum2_eight"]
        scale = max(result["full"]["param_scale"], 1.0)
        assert acc["loss"] < 1e-5 and acc["params"] < 1e-5 * scale, acc
