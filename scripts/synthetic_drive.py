"""Eq. 9's density drive: does a descent step on the task loss raise SBM's density?

  python scripts/synthetic_drive.py --preset=quick --inits=independent,tied --seeds=0,1,2

For each query/key init and seed, the synthetic model is built at its initial parameters
and, on ``--batches`` fresh batches, the gradient of the task loss ``g_L`` and the
gradient of the mean sampled density ``g_rho`` are taken on the *same* sampled graph
(same sampling key). Then

* ``-<g_L, g_rho>`` is the first-order change of density per unit step of plain gradient
  descent on the loss (positive: the loss asks for more edges);
* the same restricted to the parameters that only shape the graph (the SBM's clusters
  and membership MLP), which the task loss reaches through the straight-through
  estimator alone: eq. 9's own share (queries and keys also feed the memberships, and
  the loss reaches them through the attention scores as well);
* ``-<sign(g_L), g_rho>``: the same for Adam's first update, ``-lr * sign(g)``.

Printed per init and seed: the mean density, each drive's mean over the batches, and the
fraction of batches on which it was positive. docs/synthetic.md ("The dynamics of eq.
9") reads these figures.

Along a run:

  python scripts/train.py --config=configs/synthetic.py:quick --config.seed=0 \
      --config.checkpoint.every_steps=50 --config.checkpoint.max_to_keep=100 \
      --config.output_dir=RUN
  python scripts/synthetic_drive.py --run_dir=RUN

measures, at every checkpoint the run kept (``RUN/checkpoints/latest/<step>``, its
parameters *and* Adam state), the first-order density change of the update the optimizer
would apply next, ``<u, g_rho>`` with ``u = tx.update(g_L, opt_state, params)`` (the real
step: momentum, bias correction, warm-up and clipping included), on the run's own next
``--batches`` training batches and graphs, in total and split into the clusters + MLP
(eq. 9's own share), the query and key projections, and the rest. ``--steps=700:1100``
keeps the checkpoints in that range (a paper-length step costs seconds on a CPU).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.script_usage import UsageError  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "quick", "configs/synthetic.py preset, e.g. quick.")
_INITS = flags.DEFINE_list("inits", ["independent", "tied"], "model.query_key_init values.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (parameters, data, graphs).")
_BATCHES = flags.DEFINE_integer(
    "batches", 8, "Fresh batches per init and seed (per checkpoint with --run_dir).", lower_bound=1
)
_RUN_DIR = flags.DEFINE_string(
    "run_dir",
    "",
    "A scripts/train.py run directory: measure the drive of its next update at every "
    "checkpoint it kept, instead of at initialisation.",
)
_STEPS = flags.DEFINE_string(
    "steps", "", "With --run_dir: only checkpoints in this range, FIRST:LAST (inclusive)."
)


def setup(preset: str, init: str, seed: int) -> tuple[Any, Any, Any]:
    """``(state, task, batches)`` of the synthetic model at its initial parameters."""
    from configs import synthetic
    from sbm_jax.models.build import build_model
    from sbm_jax.tasks.registry import build_task
    from sbm_jax.training.state import create_train_state

    config = synthetic.get_config(preset)
    config.seed = seed
    config.model.query_key_init = init
    task = build_task(config)
    model = build_model(config.model, task.head)
    batches = task.train_batches(0)
    first = next(batches)
    state = create_train_state(config, model, task, first)

    def all_batches():
        yield first
        yield from batches

    return state, task, all_batches()


def density_grads_fn(task: Any) -> Callable[[Any, Any, int], tuple[Any, Any, jax.Array]]:
    """Jitted ``(state, batch, step) -> (g_L, g_rho, rho)`` for ``task``: both gradients
    on one batch and on the same sampled graph (the training step's sampling key)."""
    from sbm_jax.training.steps import loss_and_grads, step_rngs

    @jax.jit
    def grads(state: Any, batch: Any, step: int) -> tuple[Any, Any, jax.Array]:
        rngs = step_rngs(state.rng, jnp.asarray(step))
        _, _, stats, g_loss = loss_and_grads(state, task, batch, rngs, 0.0)
        _, _, _, g_both = loss_and_grads(state, task, batch, rngs, 1.0)
        g_rho = jax.tree.map(jnp.subtract, g_both, g_loss)  # (L + rho)' - L' = rho'
        return g_loss, g_rho, stats["density"]

    return grads


#: Parameter names that only shape the sampled graph (the SBM's clusters and MLP).
GRAPH_ONLY = ("clusters", "mlp_")


def drives(g_loss: Any, g_rho: Any, only: tuple[str, ...] | None = None) -> tuple[float, float]:
    """``(-<g_L, g_rho>, -<sign(g_L), g_rho>)``: density's first-order change per unit
    step of gradient descent and of Adam's first update. ``only``: sum over the
    parameters whose path contains one of these names (all when None)."""
    leaves_l = jax.tree_util.tree_leaves_with_path(g_loss)
    leaves_r = jax.tree.leaves(g_rho)
    pairs = [
        (a, b)
        for (path, a), b in zip(leaves_l, leaves_r, strict=True)
        if only is None or any(name in jax.tree_util.keystr(path) for name in only)
    ]
    sgd = -sum(float(jnp.vdot(a, b)) for a, b in pairs)
    adam = -sum(float(jnp.vdot(jnp.sign(a), b)) for a, b in pairs)
    return sgd, adam


#: The parts of an update whose drive ``--run_dir`` reports (the rest is everything else).
PARTS = {"graph": GRAPH_ONLY, "qk": ("['query']", "['key']")}


def update_drives(state: Any, g_loss: Any, g_rho: Any) -> dict[str, float]:
    """``<u, g_rho>`` for the optimizer's next update ``u`` (from ``state.opt_state``),
    in total and per part of :data:`PARTS`: the first-order change of density that the
    step actually taken would make on this graph."""
    updates, _ = state.tx.update(g_loss, state.opt_state, state.params)
    out = {"total": 0.0, **{name: 0.0 for name in PARTS}}
    leaves_r = jax.tree.leaves(g_rho)
    for (path, u), r in zip(jax.tree_util.tree_leaves_with_path(updates), leaves_r, strict=True):
        value = float(jnp.vdot(u, r))
        out["total"] += value
        name = jax.tree_util.keystr(path)
        for part, names in PARTS.items():
            if any(n in name for n in names):
                out[part] += value
                break
    out["rest"] = out["total"] - sum(out[part] for part in PARTS)
    return out


#: ``--steps`` bounds that keep every checkpoint.
ALL_STEPS = (0, 2**62)


def latest_folder(run_dir: str) -> str:
    """``run_dir``'s folder of "latest" checkpoints (the ones ``--run_dir`` measures)."""
    from sbm_jax.training.checkpoints import CHECKPOINT_DIR

    return os.path.join(run_dir, CHECKPOINT_DIR, "latest")


def run_steps(run_dir: str) -> list[int]:
    """The steps of the checkpoints ``run_dir`` kept under ``checkpoints/latest``."""
    from sbm_jax.training.checkpoints import checkpoint_steps

    folder = latest_folder(run_dir)
    steps = checkpoint_steps(folder)
    if not steps:
        raise FileNotFoundError(
            f"--run_dir={run_dir!r}: no checkpoints under {folder} (train with "
            "--config.checkpoint.every_steps=50 --config.checkpoint.max_to_keep=100)"
        )
    return steps


def step_range(text: str) -> tuple[int, int]:
    """``"FIRST:LAST"`` (either side may be empty) -> inclusive bounds."""
    first, sep, last = text.partition(":")
    if not sep:
        raise ValueError(f"--steps={text!r} must be FIRST:LAST, e.g. 700:1100 or 700:")
    try:
        bounds = int(first or ALL_STEPS[0]), int(last) if last else ALL_STEPS[1]
    except ValueError:
        raise ValueError(f"--steps={text!r}: FIRST and LAST must be integers") from None
    if bounds[0] > bounds[1]:
        raise ValueError(f"--steps={text!r}: FIRST is after LAST, so no checkpoint is in it")
    return bounds


def check_init_flags(preset: str, inits: list[str], seeds: list[str]) -> list[int]:
    """The seeds of the init mode as integers, once ``--preset``, ``--inits`` and
    ``--seeds`` are checked (a :class:`UsageError` naming the flag), before any model is
    built."""
    from configs import synthetic
    from sbm_jax.models.encoder import QUERY_KEY_INITS
    from sbm_jax.training.config_checks import config_errors, one_line

    try:
        synthetic.parse_preset(preset)
    except ValueError as err:
        raise UsageError(f"--preset={preset!r}: {err}") from None
    if not inits:
        raise UsageError(f"--inits is empty; give some of {', '.join(QUERY_KEY_INITS)}")
    for init in inits:
        if init not in QUERY_KEY_INITS:
            raise UsageError(f"--inits: {init!r} is not one of {', '.join(QUERY_KEY_INITS)}")
    if not seeds:
        raise UsageError("--seeds is empty; give some seeds, e.g. --seeds=0,1,2")
    try:
        values = [int(seed) for seed in seeds]
    except ValueError:
        raise UsageError(f"--seeds={','.join(seeds)!r}: seeds are integers >= 0") from None
    if any(seed < 0 for seed in values):
        raise UsageError(f"--seeds={','.join(seeds)!r}: seeds are integers >= 0")
    for init in inits:
        config = synthetic.get_config(preset)
        config.model.query_key_init = init
        errors = config_errors(config)
        if errors:
            raise UsageError(f"--preset={preset!r} --inits={init}: {one_line(errors)}")
    return values


def check_run_dir(run_dir: str, steps: tuple[int, int]) -> list[int]:
    """The kept checkpoint steps of ``run_dir`` within ``steps``, once it is checked to
    be a synthetic-task run with some there (a :class:`UsageError` naming the flag)."""
    from sbm_jax.training.config_checks import ConfigError
    from sbm_jax.training.run_dir import saved_config

    if not os.path.isdir(run_dir):
        raise UsageError(f"--run_dir={run_dir!r} is not a directory")
    try:
        saved = saved_config(run_dir)
    except ConfigError as err:
        raise UsageError(f"--run_dir: {err}") from None
    if saved is None:
        raise UsageError(
            f"--run_dir={run_dir!r} holds no config.json (not a scripts/train.py run?)"
        )
    task = saved.get("task") if isinstance(saved, dict) else None
    name = task.get("name") if isinstance(task, dict) else None
    if name != "synthetic":
        raise UsageError(
            f"--run_dir={run_dir!r} is a run of task {name!r}; this script measures "
            "synthetic-task runs (configs/synthetic.py)"
        )
    try:
        kept = run_steps(run_dir)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    chosen = [step for step in kept if steps[0] <= step <= steps[1]]
    if not chosen:
        raise UsageError(
            f"--steps={_STEPS.value!r}: no checkpoint of {run_dir!r} in that range (it kept "
            f"steps {kept[0]} to {kept[-1]})"
        )
    return chosen


def measure_run(
    run_dir: str, num_batches: int, steps: tuple[int, int] = ALL_STEPS
) -> list[dict[str, float]]:
    """Per kept checkpoint of ``run_dir`` with a step in ``steps`` (inclusive): its step,
    the mean density of its next ``num_batches`` training batches and the mean
    :func:`update_drives` over them."""
    import ml_collections

    from sbm_jax.models.build import build_model
    from sbm_jax.tasks.registry import build_task
    from sbm_jax.training.checkpoints import restore_snapshot
    from sbm_jax.training.run_dir import saved_config
    from sbm_jax.training.state import create_train_state

    saved = saved_config(run_dir)
    if saved is None:
        raise FileNotFoundError(f"--run_dir={run_dir!r} holds no config.json")
    config = ml_collections.ConfigDict(saved)
    task = build_task(config)
    model = build_model(config.model, task.head)
    target = create_train_state(config, model, task, next(task.train_batches(0)))
    grads = density_grads_fn(task)
    folder = latest_folder(run_dir)
    rows = []
    for step in run_steps(run_dir):
        if not steps[0] <= step <= steps[1]:
            continue
        state, _ = restore_snapshot(folder, target, step=step)
        batches = task.train_batches(step)
        dens, parts = [], []
        for i in range(num_batches):
            # The batch and graph of training step step + i (the trainer's rng per step).
            g_loss, g_rho, rho = grads(state, next(batches), step + i)
            dens.append(float(rho))
            parts.append(update_drives(state, g_loss, g_rho))
        row = {"step": step, "density": float(np.mean(dens))}
        for name in parts[0]:
            row[name] = float(np.mean([p[name] for p in parts]))
        rows.append(row)
        print(
            f"| {step} | {row['density']:.3f} | {row['total']:+.2e} | {row['graph']:+.2e} "
            f"| {row['qk']:+.2e} | {row['rest']:+.2e} |",
            flush=True,
        )
    return rows


def measure(preset: str, init: str, seed: int, num_batches: int) -> dict[str, float]:
    """Mean density, mean drives and the fraction of batches with a positive drive."""
    state, task, batches = setup(preset, init, seed)
    grads = density_grads_fn(task)
    dens, sgd, graph, adam = [], [], [], []
    for step in range(num_batches):
        g_loss, g_rho, rho = grads(state, next(batches), step)
        s, a = drives(g_loss, g_rho)
        dens.append(float(rho))
        sgd.append(s)
        graph.append(drives(g_loss, g_rho, GRAPH_ONLY)[0])
        adam.append(a)
    out = {"density": float(np.mean(dens))}
    for name, values in (("sgd", sgd), ("graph", graph), ("adam", adam)):
        out[name] = float(np.mean(values))
        out[name + "_positive"] = float(np.mean(np.asarray(values) > 0))
    return out


def main(argv: list[str]) -> None:
    if argv[1:]:
        raise UsageError(f"unexpected arguments: {' '.join(argv[1:])} (every option is a flag)")
    if _RUN_DIR.value:
        given = [name for name in ("preset", "inits", "seeds") if flags.FLAGS[name].present]
        if given:
            raise UsageError(
                f"--{', --'.join(given)}: not used with --run_dir (the run's own config is)"
            )
        try:
            bounds = step_range(_STEPS.value) if _STEPS.value else ALL_STEPS
        except ValueError as err:
            raise UsageError(str(err)) from None
        check_run_dir(_RUN_DIR.value, bounds)
        print(
            "| step | density | drive of the next update | via clusters + MLP | via query, key "
            "| via the rest |"
        )
        print("|---|---|---|---|---|---|")
        measure_run(_RUN_DIR.value, _BATCHES.value, bounds)
        return
    if _STEPS.value:
        raise UsageError(f"--steps={_STEPS.value!r} applies only with --run_dir")
    seeds = check_init_flags(_PRESET.value, _INITS.value, _SEEDS.value)
    print(
        "| QK init | seed | density | descent drive (share > 0) | of it via clusters + MLP "
        "(share > 0) | Adam-step drive (share > 0) |"
    )
    print("|---|---|---|---|---|---|")
    for init in _INITS.value:
        for seed in seeds:
            r = measure(_PRESET.value, init, seed, _BATCHES.value)
            cells = [f"{r[k]:+.2e} ({r[k + '_positive']:.2f})" for k in ("sgd", "graph", "adam")]
            row = [init, str(seed), f"{r['density']:.3f}", *cells]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    script_usage.run(main)
