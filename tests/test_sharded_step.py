"""The trainer's step: 8 sharded CPU devices vs one device, accumulation vs one pass,
the shared loop's step as the reference, and a ("data", "heads") = (4, 2) mesh with the
per-head attention parameters split over ``heads``."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest

from sbm_jax.training.config_checks import ConfigError
from sbm_jax.training.host_data import accumulation_steps
from tests.process_testing import run_and_collect, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from configs.lra import listops
    from lra.input_pipeline import batch_examples, train_examples
    from lra.train_task import MockSource
    from sbm_jax.models import build_model
    from sbm_jax.training.state import ScheduleArgs, create_train_state, learning_rate_schedule
    from sbm_jax.training.sharding import make_mesh, state_sharding
    from sbm_jax.training.steps import loss_and_grads, make_train_step, replicated, shard_batch
    from sbm_jax.training.steps import step_rngs
    from sbm_jax.training.task import Task
    from sbm_jax.training.host_data import split_micro_batches
    from sbm_jax.training.steps import micro_batch_sharding

    assert jax.device_count() == 8, jax.devices()
    out = {}
    for mech in MECHANISMS:
        config = listops.get_config(mech + ",smoke")
        config.train.batch_size = 16
        src = MockSource("listops", "train", 64, 32, 0)
        examples = train_examples(src, task="listops", max_length=32, seed=0)
        batch = batch_examples(examples, 16)[0]
        task = Task(name="t", head="classification", train_batches=None)
        model = build_model(config.model, "classification")
        schedule = learning_rate_schedule(*ScheduleArgs.of(config.train))

        def reference_step(state, batch):
            # The plain data-parallel step written out: one pass over the whole batch,
            # the step's rng streams from state.rng itself, one update.
            rngs = step_rngs(state.rng, state.step)
            _, metrics, stats, grads = loss_and_grads(state, task, batch, rngs, 0.1)
            return state.apply_gradients(grads=grads), {**metrics, **stats}

        def query_kernel(params):
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
            path = next(p for p in paths if [k.key for k in p[-2:]] == ["query", "kernel"])
            leaf = params
            for k in path:
                leaf = leaf[k.key]
            return leaf

        def run(mesh, accum, reference=False, layout=None):
            state = create_train_state(config, model, task, batch)
            if "heads" in mesh.axis_names:
                state = jax.device_put(state, state_sharding(state, mesh))
            else:
                state = jax.device_put(state, replicated(mesh))
            if reference:
                new, m = jax.jit(reference_step)(state, shard_batch(batch, mesh))
            else:
                step = make_train_step(task, mesh, 0.1, accum_steps=accum, schedule=schedule)
                b = jax.device_put(split_micro_batches(batch, accum), micro_batch_sharding(mesh))
                new, m = step(state, b)
            if layout is not None:  # where the new state's per-head parameters live
                kernel = query_kernel(new.params)
                mu = query_kernel(new.opt_state[0].mu)
                layout.update(
                    spec=[str(a) for a in kernel.sharding.spec],
                    mu_spec=[str(a) for a in mu.sharding.spec],
                    shape=list(kernel.shape),
                    shard_shapes=sorted({tuple(s.data.shape) for s in kernel.addressable_shards}),
                    devices=len(kernel.addressable_shards),
                    count_spec=list(new.opt_state[0].count.sharding.spec),
                    # every parameter split over "heads": its head axis and shard sizes
                    split={
                        "/".join(k.key for k in path): [
                            list(p.sharding.spec).index("heads"),
                            p.shape[list(p.sharding.spec).index("heads")],
                            sorted({s.data.shape[list(p.sharding.spec).index("heads")]
                                    for s in p.addressable_shards}),
                        ]
                        for path, p in jax.tree_util.tree_flatten_with_path(new.params)[0]
                        if "heads" in list(p.sharding.spec)
                    },
                )
            return jax.device_get((new.params, m["loss"], m.get("density", 0.0)))

        one = run(make_mesh(1), 1)
        ref = run(make_mesh(1), 1, reference=True)
        eight = run(make_mesh(8), 1)
        layout = {}
        heads = run(make_mesh(4, 2), 1, layout=layout)
        res = {"layout": layout}
        for name, other in (("eight", eight), ("reference", ref), ("data4_heads2", heads)):
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
            acc = run(make_mesh(4, 2), 2)
            res["accum2_data4_heads2"] = {
                "loss": abs(float(one[1]) - float(acc[1])),
                "params": max(float(np.max(np.abs(a - b))) for a, b in zip(
                    jax.tree.leaves(one[0]), jax.tree.leaves(acc[0]))),
            }
        res["param_scale"] = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(one[0]))
        out[mech] = res
    print("RESULT " + json.dumps(out))
    """
)


def _run_on_cpu_devices(devices: int, code: str, *args: str) -> dict:
    """Run ``code`` in a fresh Python with ``devices`` CPU devices; its RESULT line."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices))
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return run_and_collect([[sys.executable, "-c", code, *args]], env, timeout=600)[0]


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
    """One step on 8 devices == one step on a (data 4, heads 2) mesh == one step on 1
    device == the shared loop's step; for full attention also 2 accumulated micro-batches
    on 8 devices and on the (4, 2) mesh == one pass. On the (4, 2) mesh the new state's
    query kernel [dim, H, hd] (and its Adam moment) is split over ``heads`` on axis 1."""
    result = _run_on_cpu_devices(8, f"MECHANISMS = ({mechanism!r},)\n" + SCRIPT)
    for mech, res in result.items():
        for name in ("eight", "reference", "data4_heads2"):
            assert res[name]["loss"] < 1e-5, (mech, name, res)
            assert res[name]["density"] < 1e-5, (mech, name, res)
            assert res[name]["params"] < 1e-5 * max(res["param_scale"], 1.0), (mech, name, res)
        layout = res["layout"]
        dim, num_heads, head_dim = layout["shape"]  # smoke config: [16, 2, 8]
        assert num_heads == 2, layout
        assert layout["spec"] == ["None", "heads", "None"], layout
        assert layout["mu_spec"] == ["None", "heads", "None"], layout
        assert layout["count_spec"] == [], layout
        assert layout["devices"] == 8, layout
        assert layout["shard_shapes"] == [[dim, num_heads // 2, head_dim]], layout
        # every per-head parameter (found by its logical axis names) is split, one head
        # a device, and nothing else is
        per_head = [f"{p}/{w}" for p in ("query", "key", "value") for w in ("kernel", "bias")]
        per_head += ["out/kernel"]
        if mech == "sbm":
            per_head += ["clusters", "mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2"]
        split = layout["split"]
        assert sorted(p.split("attention/", 1)[1] for p in split) == sorted(per_head), split
        for path, (axis, size, shards) in split.items():
            want_axis = 1 if path.endswith(("query/kernel", "key/kernel", "value/kernel")) else 0
            assert (axis, size, shards) == (want_axis, num_heads, [1]), (path, split[path])
    if mechanism == "full":
        scale = max(result["full"]["param_scale"], 1.0)
        for name in ("accum2_eight", "accum2_data4_heads2"):
            acc = result["full"][name]
            assert acc["loss"] < 1e-5 and acc["params"] < 1e-5 * scale, (name, acc)


TRAINER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from configs.lra import listops
    from lra.train_task import build_lra_task
    from sbm_jax.training.trainer import train_and_evaluate

    assert jax.device_count() == 4, jax.devices()
    root = sys.argv[1]

    def config(data, heads):
        c = listops.get_config("sbm,smoke")
        c.train.num_steps = 4
        c.train.eval_every = 2
        c.mesh.data, c.mesh.heads = data, heads
        return c

    def records(out):
        with open(out + "/metrics.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    one = root + "/one"
    c = config(1, 1)
    train_and_evaluate(c, build_lra_task("listops", c), one)
    # (data 2, heads 2) to step 2, resumed on (4, 1) to step 3, then on (2, 2) to the end
    split = root + "/split"
    for (data, heads), stop in (((2, 2), 2), ((4, 1), 3), ((2, 2), None)):
        c = config(data, heads)
        train_and_evaluate(c, build_lra_task("listops", c), split, stop_after=stop)
    print("RESULT " + json.dumps({"one": records(one), "split": records(split)}))
    """
)


@pytest.mark.slow
def test_trainer_with_heads_axis_resumes_across_meshes(tmp_path):
    """``train_and_evaluate`` on a (data 2, heads 2) mesh, interrupted and resumed on a
    (4, 1) and again on a (2, 2) mesh (checkpoints restored into each layout), logs the
    same train, dev and test numbers as an uninterrupted one-device run."""
    result = _run_on_cpu_devices(4, TRAINER_SCRIPT, str(tmp_path))
    one, split = result["one"], result["split"]
    assert [(r["split"], r["step"]) for r in one] == [(r["split"], r["step"]) for r in split]
    assert [r["step"] for r in split if r["split"] == "train"] == [1, 2, 3, 4]
    for a, b in zip(one, split, strict=True):
        for key in ("loss", "accuracy", "density"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_evaluation_batches_are_padded_to_the_data_axis():
    """An eval batch of 7 rows on a data axis of 3: 2 filler rows, example_mask False
    (added as ones for the real rows when the batch had none); a batch that divides is
    left as it is."""
    from jax.sharding import AbstractMesh

    from sbm_jax.training.evaluation import fit_to_mesh

    mesh = AbstractMesh((3, 1), ("data", "heads"))
    batch = {"inputs": np.arange(14).reshape(7, 2), "targets": np.ones(7, np.int32)}
    out = fit_to_mesh(batch, mesh)
    assert out["inputs"].shape == (9, 2) and out["targets"].shape == (9,)
    np.testing.assert_array_equal(out["inputs"][:7], batch["inputs"])
    assert not out["inputs"][7:].any() and not out["targets"][7:].any()
    np.testing.assert_array_equal(out["example_mask"], [True] * 7 + [False] * 2)
    masked = dict(batch, example_mask=np.array([1, 1, 1, 1, 1, 0, 0], bool))
    np.testing.assert_array_equal(fit_to_mesh(masked, mesh)["example_mask"], [1] * 5 + [0] * 4)
    assert fit_to_mesh(dict(batch, inputs=batch["inputs"][:6], targets=np.ones(6)), mesh)[
        "inputs"
    ].shape == (6, 2)
