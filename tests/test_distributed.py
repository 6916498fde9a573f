"""Multi-process start-up: flag/env resolution, errors, and a real two-process run on
localhost (CPU collectives) checked against numpy."""

from __future__ import annotations

import os
import sys
import textwrap

import jax
import numpy as np
import pytest

from sbm_jax.training import distributed as dist
from tests.process_testing import free_port, run_and_collect, xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ENV_KEYS = (
    dist.ENV_COORDINATOR,
    dist.ENV_NUM_PROCESSES,
    dist.ENV_PROCESS_ID,
    "TPU_WORKER_HOSTNAMES",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
)


@pytest.fixture
def calls(monkeypatch):
    """Clean environment; capture jax.distributed.initialize calls instead of making them."""
    for key in _ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    captured: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: captured.append((a, k)))
    return captured


def test_single_process_is_a_no_op(calls):
    setup = dist.maybe_initialize_distributed()
    assert setup.mode == "single" and not setup.initialized
    assert calls == []
    # One process named explicitly is still a single process.
    assert dist.maybe_initialize_distributed(num_processes=1, process_id=0).mode == "single"
    assert calls == []


def test_explicit_flags_are_passed_through(calls):
    setup = dist.maybe_initialize_distributed("10.0.0.2:8476", 4, 3)
    assert setup.mode == "explicit"
    assert calls == [
        ((), {"coordinator_address": "10.0.0.2:8476", "num_processes": 4, "process_id": 3})
    ]


def test_environment_variables(calls, monkeypatch):
    monkeypatch.setenv("SBM_COORDINATOR", "host-0:1234")
    monkeypatch.setenv("SBM_NUM_PROCESSES", "2")
    monkeypatch.setenv("SBM_PROCESS_ID", "1")
    dist.maybe_initialize_distributed()
    assert calls[-1] == (
        (),
        {"coordinator_address": "host-0:1234", "num_processes": 2, "process_id": 1},
    )
    # A flag wins over its variable; the others still come from the environment.
    dist.maybe_initialize_distributed(process_id=0)
    assert calls[-1][1]["process_id"] == 0 and calls[-1][1]["num_processes"] == 2


@pytest.mark.parametrize(
    "env",
    [
        {"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3", "TPU_WORKER_ID": "2"},
        {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8", "SLURM_PROCID": "5"},
    ],
    ids=["tpu", "slurm"],
)
def test_cluster_detection_calls_initialize_without_arguments(calls, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    setup = dist.maybe_initialize_distributed()
    assert setup.mode == ("tpu" if "TPU_WORKER_HOSTNAMES" in env else "slurm")
    assert calls == [((), {})]


@pytest.mark.parametrize(
    "env",
    [{"TPU_WORKER_HOSTNAMES": "localhost"}, {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"}],
    ids=["tpu-single-host", "slurm-one-task"],
)
def test_single_host_clusters_are_no_ops(calls, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert dist.maybe_initialize_distributed().mode == "single"
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, env, pattern",
    [
        (
            {"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
            {},
            r"--process_id=2 is out of range for --num_processes=2 \(process ids are 0..1\)",
        ),
        (
            {"coordinator_address": "h:1"},
            {"SBM_NUM_PROCESSES": "4", "SBM_PROCESS_ID": "4"},
            r"SBM_PROCESS_ID=4 is out of range for SBM_NUM_PROCESSES=4",
        ),
        (
            {"num_processes": 2, "process_id": 0},
            {},
            r"missing --coordinator_address \(or \$SBM_COORDINATOR\)",
        ),
        (
            {"coordinator_address": "h:1"},
            {},
            r"missing --num_processes \(or \$SBM_NUM_PROCESSES\), --process_id",
        ),
        ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, {}, "host:port"),
        ({}, {"SBM_NUM_PROCESSES": "two"}, "SBM_NUM_PROCESSES must be an integer"),
        ({"num_processes": 0}, {}, "--num_processes must be >= 1"),
        ({"num_processes": 1, "process_id": 1}, {}, "--process_id=1 is out of range"),
        ({"process_id": -1}, {}, "--process_id must be >= 0"),
    ],
)
def test_inconsistent_values_name_the_flag(calls, monkeypatch, kwargs, env, pattern):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(dist.DistributedConfigError, match=pattern):
        dist.maybe_initialize_distributed(**kwargs)
    assert calls == []


# --- a real two-process job on localhost -------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sbm_jax.training import distributed as dist

    coordinator, nproc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    setup = dist.maybe_initialize_distributed(coordinator, nproc, pid)
    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype(np.float32)   # the same global batch everywhere
    y = rng.normal(size=(8,)).astype(np.float32)
    w = np.array([0.5, -1.0, 2.0], np.float32)
    rows = 8 // jax.process_count()  # this process's rows, in process order
    part = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    local = {"x": x[part], "y": y[part]}
    batch = {
        k: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data", *([None] * (v.ndim - 1)))), v,
            (v.shape[0] * jax.process_count(), *v.shape[1:]))
        for k, v in local.items()
    }
    replicated = NamedSharding(mesh, P())

    @jax.jit
    def loss_and_grad(w, batch):
        loss = lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
        return jax.value_and_grad(loss)(w)

    loss, grad = jax.jit(loss_and_grad, out_shardings=replicated)(w, batch)
    col_sums = jax.jit(
        jax.shard_map(
            lambda xs: jax.lax.psum(xs.sum(axis=0), "data"),
            mesh=mesh, in_specs=P("data"), out_specs=P(),
        ),
        out_shardings=replicated,
    )(batch["x"])
    print("RESULT " + json.dumps({
        "mode": setup.mode, "primary": jax.process_index() == 0,
        "processes": jax.process_count(), "devices": jax.device_count(),
        "local_rows": int(local["x"].shape[0]),
        "loss": float(loss), "grad": np.asarray(grad).tolist(),
        "col_sums": np.asarray(col_sums).tolist(),
    }), flush=True)
    """
)


def _run_workers(script: str, nproc: int, devices_per_process: int) -> list[dict]:
    env = dict(os.environ)
    for key in _ENV_KEYS:
        env.pop(key, None)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=xla_flags(devices_per_process),
        PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
    )
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, script, coordinator, str(nproc), str(i)] for i in range(nproc)]
    return run_and_collect(commands, env, timeout=120)


def test_two_processes_on_localhost_match_one_process_and_numpy(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    two = _run_workers(str(script), nproc=2, devices_per_process=2)
    one = _run_workers(str(script), nproc=1, devices_per_process=4)

    # Independent reference: numpy on the full global batch.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype(np.float64)
    y = rng.normal(size=(8,)).astype(np.float64)
    w = np.array([0.5, -1.0, 2.0])
    residual = x @ w - y
    ref_loss = np.mean(residual**2)
    ref_grad = 2.0 * x.T @ residual / len(y)

    assert [r["mode"] for r in two] == ["explicit", "explicit"]
    assert [r["primary"] for r in two] == [True, False]
    assert all(r["processes"] == 2 and r["devices"] == 4 and r["local_rows"] == 4 for r in two)
    assert one[0]["mode"] == "single" and one[0]["devices"] == 4 and one[0]["local_rows"] == 8
    for r in two + one:
        np.testing.assert_allclose(r["loss"], ref_loss, rtol=1e-5)
        np.testing.assert_allclose(r["grad"], ref_grad, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["col_sums"], x.sum(axis=0), rtol=1e-5, atol=1e-6)
    # Both processes see the same replicated result, equal to the single-process one
    # up to float32 summation order.
    assert two[0]["loss"] == two[1]["loss"] and two[0]["grad"] == two[1]["grad"]
    np.testing.assert_allclose(two[0]["grad"], one[0]["grad"], rtol=1e-6, atol=1e-7)


def test_a_detected_cluster_jax_cannot_join_is_one_line(calls, monkeypatch):
    """Inside a Slurm allocation without srun JAX finds no coordinator: the ValueError
    from jax.distributed.initialize becomes one line that says what was detected and how
    to run (the trainer prints it with exit status 2)."""

    def fail(*args, **kwargs):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", fail)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(dist.DistributedConfigError) as info:
        dist.maybe_initialize_distributed()
    message = str(info.value)
    assert "\n" not in message and message.startswith("a Slurm job (SLURM_JOB_ID")
    assert "coordinator_address should be defined" in message and "SBM_NUM_PROCESSES=1" in message
    monkeypatch.setenv("SBM_NUM_PROCESSES", "1")
    assert dist.maybe_initialize_distributed().mode == "single"
