"""RunCheckpoints: save / restore round trips, best vs latest, retention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from sbm_jax.training.checkpoints import RunCheckpoints
from sbm_jax.training.state import TrainState


def _state(seed: int = 0) -> TrainState:
    params = {"w": jax.random.normal(jax.random.PRNGKey(seed), (3, 4)), "b": jnp.zeros(4)}
    return TrainState.create(
        apply_fn=lambda *a, **k: None,
        params=params,
        tx=optax.adamw(1e-2, eps=1e-6),
        rng=jax.random.PRNGKey(7),
    )


def _step(state: TrainState) -> TrainState:
    grads = jax.tree.map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads)


def test_latest_round_trip_keeps_optimizer_state_and_meta(tmp_path):
    state = _step(_step(_state()))
    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=2)
    ckpts.save_latest(state, {"best": 0.5, "best_step": 2})
    ckpts.close()

    fresh = _state(seed=1)  # different values, same structure
    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=2)
    restored, meta = ckpts.restore_latest(fresh)
    ckpts.close()
    assert meta == {"best": 0.5, "best_step": 2}
    assert int(restored.step) == 2
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # optax state types survive (a further step works and matches the uninterrupted one)
    np.testing.assert_allclose(
        _step(restored).params["w"], _step(state).params["w"], rtol=0, atol=0
    )


def test_best_is_separate_and_retention(tmp_path):
    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=2)
    assert ckpts.restore_latest(_state()) is None and ckpts.restore_best(_state()) is None
    state = _state()
    for i in range(4):
        state = _step(state)
        ckpts.save_latest(state, {"i": i})
        if i == 1:
            ckpts.save_best(state, {"best_step": 2})
    assert ckpts.latest_step() == 4 and ckpts.best_step() == 2
    assert sorted(ckpts._latest.all_steps()) == [3, 4]  # max_to_keep=2
    best, meta = ckpts.restore_best(_state())
    assert int(best.step) == 2 and meta == {"best_step": 2}
    ckpts.close()


def test_bad_max_to_keep_is_named(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.max_to_keep"):
        RunCheckpoints(str(tmp_path), max_to_keep=0)


def test_config_dict_meta_is_not_required(tmp_path):
    # meta must be JSON; a ConfigDict's dict form is.
    meta = ml_collections.ConfigDict({"a": 1}).to_dict()
    ckpts = RunCheckpoints(str(tmp_path))
    ckpts.save_latest(_state(), meta)
    assert ckpts.restore_latest(_state())[1] == {"a": 1}
    ckpts.close()


def test_an_unreadable_latest_checkpoint_is_set_aside_for_the_one_before(tmp_path):
    """A truncated meta or state file of the newest checkpoint: the restore takes the
    one before, moves the damaged one (kept) out of orbax's view and reports it; a
    later save at its step then really saves. None readable: one error naming them."""
    import os

    from sbm_jax.training.checkpoints import CheckpointError

    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=3)
    state = _state()
    for i in range(3):
        state = _step(state)
        ckpts.save_latest(state, {"i": i})
    ckpts.close()
    meta_file = tmp_path / "latest" / "3" / "meta" / "metadata"
    meta_file.write_text(meta_file.read_text()[:5])  # a torn JSON write
    state_dir = tmp_path / "latest" / "2" / "state"
    biggest = max((p for p in state_dir.rglob("*") if p.is_file()), key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(max(1, os.path.getsize(biggest) // 3))

    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=3)
    reported = []
    restored, meta = ckpts.restore_latest(_state(1), on_unreadable=lambda *a: reported.append(a))
    assert int(restored.step) == 1 and meta == {"i": 0}
    assert [step for step, _, _ in reported] == [3, 2]
    for step, moved, _ in reported:
        assert moved == str(tmp_path / "unreadable" / f"latest-{step}") and os.path.isdir(moved)
    assert ckpts.latest_step() == 1
    ckpts.save_latest(_step(_step(restored)), {"i": 1})  # step 3 again: saved, not skipped
    assert ckpts.latest_step() == 3
    ckpts.close()

    (tmp_path / "latest" / "1" / "meta" / "metadata").write_text("{")
    (tmp_path / "latest" / "3" / "meta" / "metadata").write_text("{")
    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=3)
    with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*steps \[3, 1\]"):
        ckpts.restore_latest(_state())
    ckpts.close()


def test_a_best_checkpoint_after_the_resumed_step_is_dropped(tmp_path):
    ckpts = RunCheckpoints(str(tmp_path))
    state = _step(_step(_state()))
    ckpts.save_best(state, {"best_step": 2})
    assert ckpts.drop_best_after(2) is None and ckpts.best_step() == 2
    assert ckpts.drop_best_after(1) == 2 and ckpts.best_step() is None
    ckpts.close()


def test_a_damaged_state_file_and_a_damaged_best_are_set_aside(tmp_path):
    """A truncated shard of the newest checkpoint (arrays big enough to live in OCDBT's
    data files, not inline): the restore falls back to the one before; a damaged best
    checkpoint is set aside the same way and reads as none (the trainer then tests its
    last state)."""
    import os

    big = TrainState.create(
        apply_fn=lambda *a, **k: None,
        # random, so that zstd leaves them above OCDBT's 1 KiB inline limit
        params={"w": jax.random.normal(jax.random.PRNGKey(3), (64, 64)), "b": jnp.zeros(64)},
        tx=optax.adamw(1e-2),
        rng=jax.random.PRNGKey(7),
    )
    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=3)
    state = big
    for i in range(2):
        state = _step(state)
        ckpts.save_latest(state, {"i": i})
    ckpts.save_best(state, {"i": 1})
    ckpts.close()
    for kind in ("latest", "best"):
        data = tmp_path / kind / "2" / "state" / "ocdbt.process_0" / "d"
        biggest = max(data.iterdir(), key=lambda p: p.stat().st_size)
        with open(biggest, "r+b") as f:
            f.truncate(100)
    ckpts = RunCheckpoints(str(tmp_path), max_to_keep=3)
    reported = []
    restored, _ = ckpts.restore_latest(big, on_unreadable=lambda *a: reported.append(a))
    assert int(restored.step) == 1 and [r[0] for r in reported] == [2]
    assert ckpts.restore_best(big, on_unreadable=lambda *a: reported.append(a)) is None
    assert [r[0] for r in reported] == [2, 2] and ckpts.best_step() is None
    assert os.path.isdir(tmp_path / "unreadable" / "best-2")
    ckpts.close()


def test_the_reports_of_a_failed_read_are_dropped_and_nothing_else():
    """After a restore fails, orbax's abandoned read coroutines and its closed event loop
    report themselves through sys.unraisablehook, the asyncio logger and a RuntimeWarning
    (2962 lines in a 10-step resume of the synthetic quick run, 5 with the filter).
    The filter drops exactly those; other reports reach the previous hook; undo
    restores it."""
    import logging
    import sys
    from types import SimpleNamespace

    from sbm_jax.training.checkpoints import _silence_failed_reads

    seen = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        undo = _silence_failed_reads()
        for exc in (
            Exception("Encountered error while reading array index: (slice(0, 32, 1),)"),
            ValueError('OUT_OF_RANGE: Error reading "w/0" in OCDBT database at local file'),
            RuntimeError("Event loop is closed"),
        ):
            sys.unraisablehook(SimpleNamespace(exc_value=exc, object=None))
        assert seen == []
        other = SimpleNamespace(exc_value=ValueError("something else"), object=None)
        sys.unraisablehook(other)
        assert seen == [other]
        record = logging.LogRecord("asyncio", logging.ERROR, "", 0, "never retrieved", (), None)
        record.exc_info = (
            Exception,
            Exception("Encountered error while reading array index"),
            None,
        )
        assert not logging.getLogger("asyncio").filter(record)
        record.exc_info = (ValueError, ValueError("unrelated"), None)
        assert logging.getLogger("asyncio").filter(record)
        undo()
        assert sys.unraisablehook == seen.append
    finally:
        sys.unraisablehook = previous


def test_init_from_params_load_whatever_devices_saved_them(tmp_path):
    """A run saved on 2 devices, read for config.init_from on 1 (pretraining on a
    2-GPU host, fine-tuning on one): orbax rebuilt the saved sharding and failed with
    "Topology mismatch"; load_params now restores onto this process's device."""
    import os
    import subprocess
    import sys

    from sbm_jax.training.checkpoints import find_checkpoint, load_params
    from tests.process_testing import xla_flags

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = tmp_path / "run"
    saved = tmp_path / "params.npz"
    script = f"""
import jax, numpy as np
from sbm_jax.training import cli
from sbm_jax.training.checkpoints import find_checkpoint, load_params
assert jax.device_count() == 2
status = cli.main(["train.py", "--config={root}/configs/synthetic.py:full,smoke",
    "--config.task.seq_len=8", "--config.train.batch_size=8", "--config.train.num_steps=2",
    "--output_dir={run}"], task_modules=())
assert status == 0, status
leaves = jax.tree_util.tree_leaves_with_path(load_params(find_checkpoint("{run}")))
np.savez("{saved}", **{{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}})
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root, XLA_FLAGS=xla_flags(2))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert jax.device_count() == 1
    here = jax.tree_util.tree_leaves_with_path(load_params(find_checkpoint(str(run))))
    there = np.load(saved)
    assert sorted(there.files) == sorted(jax.tree_util.keystr(k) for k, _ in here)
    for key, value in here:
        np.testing.assert_array_equal(np.asarray(value), there[jax.tree_util.keystr(key)])


def test_an_abstract_target_restores_the_saved_state_with_its_shardings(tmp_path):
    """On 8 devices, a (4, 2) mesh: a state whose parameters (and Adam moments) split
    over ``heads`` and rows over ``data``, saved, then restored into
    ``abstract_state(fresh host state, shardings)``: every leaf comes back bit for bit
    with the sharding asked for (the trainer's restore target since it stopped holding
    a placed fresh state)."""
    import os
    import subprocess
    import sys

    from tests.process_testing import xla_flags

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = f"""
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sbm_jax.training.checkpoints import RunCheckpoints, abstract_state
from sbm_jax.training.state import TrainState
assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "heads"))

def host(seed):
    params = {{"w": jax.random.normal(jax.random.PRNGKey(seed), (4, 6)), "b": jnp.zeros(6)}}
    return TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-2),
                             rng=jax.random.PRNGKey(7))

def spec(path, leaf):
    name = jax.tree_util.keystr(path)
    if getattr(leaf, "ndim", 0) == 2:
        return NamedSharding(mesh, P("data", "heads"))
    if getattr(leaf, "ndim", 0) == 1 and "b" in name:
        return NamedSharding(mesh, P("heads"))
    return NamedSharding(mesh, P())

state = host(0)
shardings = jax.tree_util.tree_map_with_path(spec, state)
placed = jax.device_put(state, shardings)
placed = placed.apply_gradients(grads=jax.tree.map(jnp.ones_like, placed.params))
ckpts = RunCheckpoints("{tmp_path}/ckpt")
ckpts.save_best(placed, {{"best_step": 1}})
target = abstract_state(state, shardings)  # as the trainer: its host state
assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target))
best, meta = ckpts.restore_best(target)
ckpts.close()
assert meta == {{"best_step": 1}} and int(best.step) == 1
split = 0
for a, b, s in zip(jax.tree.leaves(placed), jax.tree.leaves(best), jax.tree.leaves(shardings),
                   strict=True):
    assert b.sharding.is_equivalent_to(s, b.ndim), (b.sharding, s)
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    split += len(b.sharding.device_set) == 8 and b.sharding.spec != P()
assert split == 6, split  # w and b in params, mu and nu
print("OK")
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root, XLA_FLAGS=xla_flags(8))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
