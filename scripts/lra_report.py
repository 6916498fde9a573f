"""Turn LRA run summaries into the paper's tables and figures.

  python scripts/lra_report.py --root=runs/lra --out=reports/lra

Reads every ``<root>/**/summary.json`` (written by ``scripts/train.py`` with an LRA
config) and writes into ``--out``:

* ``table1_accuracy.md``: test accuracy (mean ± std over seeds) per mechanism and task;
  SBM rows (lambda 0) also give the test density in parentheses (paper Table 1).
* ``table2_lambda.md``: SBM's lambda vs test accuracy and density per task (Table 2).
* ``table3_cost.md``: per task and mechanism, attention FLOPs per example relative to
  full attention (analytic, ``sbm_jax.analysis.flops.attention_flops`` summed over
  layers; SBM at its measured per-layer test density) and peak memory per example at
  inference relative to full attention (XLA's memory analysis of the compiled
  batch-1 forward pass: arguments + outputs + temporaries) (Table 3).
* ``fig5_density_per_layer.png``: SBM's test density per layer and head, per task, mean
  and standard deviation over the test set (fig. 5), as the model sowed it in the test
  evaluation (``summary.json``'s ``test_density_per_head``).
* ``table2_tradeoff.png``: Table 2 as a figure, test accuracy against test density per
  lambda, for tasks with runs at two or more lambdas.
* ``fig7_image_density.png`` / ``fig8_pathfinder_density.png``: for a few test inputs of
  Image / Pathfinder at the best checkpoint, the input and, per SBM layer and head, each
  pixel's expected key density (the fraction of pixels that attend to it, ``mean_i
  p_ij``) titled with the head's sampled density on that input (figs. 7, 8): the values
  the SBM layer sows (``key_density``, ``density``), read by running the model. Needs
  the run's checkpoint and data.
* ``report.json``: every number above.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.training.run_dir import SAFE_TO_CHANGE, config_differences  # noqa: E402

TASK_ORDER = ("listops", "text", "retrieval", "image", "pathfinder")

_ROOT = flags.DEFINE_string("root", "runs/lra", "Directory searched for summary.json files.")
_OUT = flags.DEFINE_string("out", "reports/lra", "Output directory.")
_MAPS = flags.DEFINE_integer("num_maps", 3, "Inputs per density-map figure (0: none).")


class ReportError(script_usage.UsageError):
    """The runs under --root cannot make one report: one line, exit status 2."""


#: Config fields in which runs averaged together (one mechanism, task and lambda) may
#: differ: the seed, and what a resumed run may change without changing its result
#: (logging, checkpoints, data location, device layout); not how long it trained.
GROUP_FREE = ("seed",) + tuple(
    f for f in SAFE_TO_CHANGE if f not in ("train.num_steps", "train.num_epochs")
)


def load_summaries(root: str, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """All LRA run summaries under ``root``, each with ``run_dir`` (the folder it was
    found in: the run's own ``output_dir`` may name where it was before a move).

    A summary that cannot be read (a write cut short) is left out, and so are runs
    without one (unfinished); both are said in ``notes``.
    """
    notes = [] if notes is None else notes
    out = []
    paths = sorted(glob.glob(os.path.join(root, "**", "summary.json"), recursive=True))
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                summary = json.load(f)
        except (OSError, ValueError) as e:
            notes.append(f"{path} is unreadable ({type(e).__name__}): left out")
            continue
        if not isinstance(summary, dict):
            notes.append(f"{path} is not a run summary: left out")
            continue
        if str(summary.get("task", "")).startswith("lra_"):
            summary["task_short"] = summary["task"][len("lra_") :]
            summary["run_dir"] = os.path.dirname(os.path.abspath(path))
            out.append(summary)
    finished = {os.path.dirname(os.path.abspath(p)) for p in paths}
    for config in sorted(glob.glob(os.path.join(root, "**", "config.json"), recursive=True)):
        run = os.path.dirname(os.path.abspath(config))
        if run not in finished:
            notes.append(f"{run} has no summary.json (unfinished): left out")
    return out


def check_groups(summaries: list[dict[str, Any]]) -> None:
    """Runs averaged together (one mechanism, task and lambda) must be seeds of one
    config: two runs of a seed, or runs of different presets or lengths, would be
    averaged silently into one cell. Raises ``ReportError`` naming both runs."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        key = (s.get("attention"), s["task_short"], float(s.get("density_lambda") or 0.0))
        groups[key].append(s)
    for (mech, task, lam), runs in groups.items():
        seen: dict[Any, str] = {}
        for run in runs:
            seed = run.get("seed")
            if seed in seen:
                raise ReportError(
                    f"{seen[seed]} and {run['run_dir']} are both {task} {mech} lambda {lam:g} "
                    f"seed {seed}: move one out of --root"
                )
            seen[seed] = run["run_dir"]
        first = runs[0]
        for run in runs[1:]:
            diffs = config_differences(
                first.get("config") or {}, run.get("config") or {}, safe=GROUP_FREE
            )
            if diffs:
                shown = "; ".join(diffs[:3]) + ("; ..." if len(diffs) > 3 else "")
                raise ReportError(
                    f"{first['run_dir']} and {run['run_dir']} ({task} {mech} lambda {lam:g}) "
                    f"are not seeds of one config ({shown}): report them from separate roots"
                )


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    arr = np.asarray(values, np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def _fmt(values: Sequence[float], scale: float = 100.0) -> str:
    if not values:
        return "-"
    m, s = mean_std(values)
    return f"{scale * m:.2f} ± {scale * s:.2f}"


def _tasks(summaries: list[dict[str, Any]]) -> list[str]:
    present = {s["task_short"] for s in summaries}
    return [t for t in TASK_ORDER if t in present]


def table1(summaries: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown Table 1 and its numbers {mechanism: {task: {...}}}."""
    tasks = _tasks(summaries)
    groups: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        if s["attention"] == "sbm" and s.get("density_lambda", 0.0):
            continue
        groups[s["attention"]][s["task_short"]].append(s)
    numbers: dict[str, Any] = {}
    lines = [
        "| mechanism | " + " | ".join(tasks) + " | avg |",
        "|---|" + "---|" * (len(tasks) + 1),
    ]
    for mech in sorted(groups):
        cells, means = [], []
        numbers[mech] = {}
        for task in tasks:
            runs = groups[mech].get(task, [])
            acc = [r["test_accuracy"] for r in runs if r.get("test_accuracy") is not None]
            dens = [r["test_density"] for r in runs if r.get("test_density") is not None]
            cell = _fmt(acc)
            if mech == "sbm" and dens:
                cell += f" ({_fmt(dens)}%)"
            cells.append(cell)
            if acc:
                means.append(np.mean(acc))
                numbers[mech][task] = {
                    "accuracy": mean_std(acc),
                    "density": mean_std(dens) if dens else None,
                    "seeds": len(acc),
                }
        avg = f"{100 * np.mean(means):.2f}" if len(means) == len(tasks) else "-"
        lines.append(f"| {mech} | " + " | ".join(cells) + f" | {avg} |")
    text = "Test accuracy (%), mean ± std over seeds; SBM: (test density %).\n\n"
    return text + "\n".join(lines) + "\n", numbers


def table2(summaries: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown Table 2 (SBM lambda vs accuracy and density) and its numbers."""
    tasks = _tasks(summaries)
    groups: dict[float, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        if s["attention"] == "sbm":
            groups[float(s.get("density_lambda", 0.0))][s["task_short"]].append(s)
    lines = [
        "| lambda | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    numbers: dict[str, Any] = {}
    for lam in sorted(groups):
        cells = []
        numbers[f"{lam:g}"] = {}
        for task in tasks:
            runs = groups[lam].get(task, [])
            acc = [r["test_accuracy"] for r in runs if r.get("test_accuracy") is not None]
            dens = [r["test_density"] for r in runs if r.get("test_density") is not None]
            cells.append(f"{_fmt(acc)} ({_fmt(dens)}%)" if acc else "-")
            if acc:
                numbers[f"{lam:g}"][task] = {
                    "accuracy": mean_std(acc),
                    "density": mean_std(dens) if dens else None,
                }
        lines.append(f"| {lam:g} | " + " | ".join(cells) + " |")
    text = "SBM: test accuracy % (test density %) per density-regulariser weight lambda.\n\n"
    return text + "\n".join(lines) + "\n", numbers


def _config(summary: dict[str, Any]) -> Any:
    import ml_collections

    return ml_collections.ConfigDict(summary["config"])


def layer_densities(summary: dict[str, Any]) -> list[float]:
    """Mean test density per encoder layer (heads averaged), in layer order."""
    per_head = summary.get("test_density_per_head") or {}
    return [float(np.mean(per_head[k]["mean"])) for k in sorted(per_head)]


def attention_flops_per_example(summary: dict[str, Any]) -> float:
    """Analytic attention FLOPs of one example summed over layers (SBM: per-layer test
    density)."""
    from sbm_jax.analysis import attention_flops

    cfg = _config(summary)
    model = cfg.model
    layers = int(model.num_layers)
    densities = layer_densities(summary) if model.attention == "sbm" else []
    if model.attention == "sbm" and len(densities) != layers:
        # Dual encoders call each layer twice; per_head keys are per module, so this
        # still lists one entry per layer. Anything else: fall back to the mean.
        densities = [summary.get("test_density") or 1.0] * layers
    calls = 2 if summary["task_short"] == "retrieval" else 1  # two documents per example
    total = 0.0
    for layer in range(layers):
        total += attention_flops(
            str(model.attention),
            seq_len=int(cfg.task.max_length),
            emb_dim=int(model.emb_dim),
            num_heads=int(model.num_heads),
            head_dim=int(model.head_dim),
            options=model.attention_options.to_dict(),
            density=densities[layer] if densities else None,
        )["total"]
    return calls * total


def peak_memory_per_example(summary: dict[str, Any]) -> float:
    """Bytes XLA reserves for one batch-1 inference forward pass (arguments + outputs
    + temporaries), from the compiled executable's memory analysis."""
    import jax
    import jax.numpy as jnp

    from sbm_jax.models import build_model

    cfg = _config(summary)
    dual = summary["task_short"] == "retrieval"
    model = build_model(cfg.model, "dual_encoder" if dual else "classification")
    length = int(cfg.task.max_length)
    ids = jnp.ones((1, length), jnp.int32)
    mask = jnp.ones((1, length), bool)
    inputs = (
        {"inputs0": ids, "mask0": mask, "inputs1": ids, "mask1": mask}
        if dual
        else {"inputs": ids, "mask": mask}
    )
    rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}
    params = jax.eval_shape(lambda: model.init(rngs, **inputs, deterministic=True))["params"]

    def forward(params, inputs, rng):
        return model.apply({"params": params}, **inputs, deterministic=True, rngs={"sample": rng})

    compiled = jax.jit(forward).lower(params, inputs, jax.random.PRNGKey(2)).compile()
    mem = compiled.memory_analysis()
    if mem is None:
        return math.nan
    return float(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)


def table3(summaries: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown Table 3: FLOPs and peak memory relative to full attention."""
    tasks = _tasks(summaries)
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for s in summaries:
        if s["attention"] == "sbm" and s.get("density_lambda", 0.0):
            continue
        first.setdefault((s["attention"], s["task_short"]), s)
    numbers: dict[str, Any] = defaultdict(dict)
    for (mech, task), s in sorted(first.items()):
        # SBM: average the analytic FLOPs over its seeds' densities.
        runs = [
            r
            for r in summaries
            if r["attention"] == mech
            and r["task_short"] == task
            and not (mech == "sbm" and r.get("density_lambda", 0.0))
        ]
        flops = float(np.mean([attention_flops_per_example(r) for r in runs]))
        numbers[mech][task] = {"flops": flops, "peak_bytes": peak_memory_per_example(s)}
    mechs = sorted(numbers)
    lines = [
        "| mechanism | " + " | ".join(f"{t} FLOPs | {t} memory" for t in tasks) + " |",
        "|---|" + "---|---|" * len(tasks),
    ]
    for mech in mechs:
        cells = []
        for task in tasks:
            mine, full = numbers[mech].get(task), numbers.get("full", {}).get(task)
            if mine is None or full is None:
                cells += ["-", "-"]
                continue
            mine["relative_flops"] = mine["flops"] / full["flops"]
            mine["relative_memory"] = mine["peak_bytes"] / full["peak_bytes"]
            cells += [f"{mine['relative_flops']:.3f}", f"{mine['relative_memory']:.3f}"]
        lines.append(f"| {mech} | " + " | ".join(cells) + " |")
    text = (
        "Attention FLOPs per example (analytic, all layers; SBM at its test density) and "
        "peak inference memory per example (XLA memory analysis, batch 1), both relative "
        "to full attention.\n\n"
    )
    return text + "\n".join(lines) + "\n", dict(numbers)


def head_densities(summary: dict[str, Any]) -> list[tuple[list[float], list[float]]]:
    """Per encoder layer (in layer order): the test density of each head, as sown by the
    model during the test evaluation, ``(mean [heads], std [heads])`` over test examples."""
    per_head = summary.get("test_density_per_head") or {}
    out = []
    for key in sorted(per_head):
        entry = per_head[key]
        mean = [float(v) for v in entry["mean"]]
        std = [float(v) for v in entry.get("std", [0.0] * len(mean))]
        out.append((mean, std))
    return out


def figure5(summaries: list[dict[str, Any]], path: str) -> str | None:
    """Fig. 5: SBM's test density per layer and head, per task (lambda 0): the mean over
    the test set with its standard deviation over test examples as the error bar (seeds
    averaged), from the densities the model sows in evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def lambda0_sbm(task: str) -> list[dict[str, Any]]:
        return [
            s
            for s in summaries
            if s["attention"] == "sbm"
            and s["task_short"] == task
            and not s.get("density_lambda")
            and s.get("test_density_per_head")
        ]

    tasks = [t for t in _tasks(summaries) if lambda0_sbm(t)]
    if not tasks:
        return None
    per_task: dict[str, list[tuple[str, float, float]]] = {}
    for task in tasks:
        runs = [head_densities(s) for s in lambda0_sbm(task)]
        bars = []
        for layer in range(min(len(r) for r in runs)):
            heads = min(len(r[layer][0]) for r in runs)
            for head in range(heads):
                mean = float(np.mean([r[layer][0][head] for r in runs]))
                std = float(np.mean([r[layer][1][head] for r in runs]))
                bars.append((f"L{layer + 1}H{head + 1}", mean, std))
        per_task[task] = bars
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(1.2 + 2.2 * len(tasks), 3.2), squeeze=False, sharey=True
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        labels, means, stds = zip(*per_task[task], strict=True)
        colors = [f"C{int(label[1 : label.index('H')]) - 1}" for label in labels]
        ax.bar(
            range(len(labels)),
            [100 * m for m in means],
            yerr=[100 * v for v in stds],
            color=colors,
            capsize=3,
        )
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(task, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test density (%), mean ± std")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure_tradeoff(summaries: list[dict[str, Any]], path: str) -> str | None:
    """Table 2 as a figure: SBM's test accuracy against its test density, one point per
    density-regulariser weight lambda (seeds averaged), one line per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, dict[float, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for s in summaries:
        if (
            s["attention"] == "sbm"
            and s.get("test_accuracy") is not None
            and s.get("test_density") is not None
        ):
            lam = float(s.get("density_lambda", 0.0))
            points[s["task_short"]][lam].append((s["test_density"], s["test_accuracy"]))
    tasks = [t for t in _tasks(summaries) if len(points.get(t, {})) >= 2]
    if not tasks:
        return None
    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    for task in tasks:
        lams = sorted(points[task])
        dens = [100 * float(np.mean([p[0] for p in points[task][lam]])) for lam in lams]
        acc = [100 * float(np.mean([p[1] for p in points[task][lam]])) for lam in lams]
        ax.plot(dens, acc, "o-", label=task)
        for lam, x, y in zip(lams, dens, acc, strict=True):
            ax.annotate(f"{lam:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("test density (%)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("accuracy vs density per lambda", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _natural(path: str) -> list[Any]:
    """Sort key that puts ``block_2`` before ``block_10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def sown_token_densities(
    model: Any, params: Any, inputs: dict[str, Any], rng: Any = None
) -> dict[str, dict[str, np.ndarray]]:
    """What each SBM attention layer sows on ``inputs`` in evaluation (graph sampling on,
    no dropout): {module path, in layer order: {``density [B, H]`` (the sampled graph's
    density), ``query_density``, ``key_density [B, H, L]``}}.

    Read from the model's ``attention_stats`` (see
    :func:`sbm_jax.attention.sbm.expected_token_densities`); a layer called twice (dual
    encoder) gives its first call's values.
    """
    import jax
    from flax import traverse_util

    from sbm_jax.attention import STATS_COLLECTION

    rng = jax.random.PRNGKey(0) if rng is None else rng

    @jax.jit
    def run(params: Any, inputs: dict[str, Any], rng: Any) -> Any:
        return model.apply(
            {"params": params},
            **inputs,
            deterministic=True,
            rngs={"sample": rng},
            mutable=[STATS_COLLECTION],
        )[1]

    mutables = run(params, inputs, rng)
    flat = traverse_util.flatten_dict(dict(mutables.get(STATS_COLLECTION, {})))
    out: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    for path, values in flat.items():
        if path[-1] in ("density", "query_density", "key_density"):
            first = values[0] if isinstance(values, tuple) else values
            out["/".join(str(p) for p in path[:-1])][path[-1]] = np.asarray(first)
    return {k: out[k] for k in sorted(out, key=_natural) if "query_density" in out[k]}


def load_test_examples(
    summary: dict[str, Any], num_inputs: int
) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """(model, params at the run's best checkpoint, batch of its first ``num_inputs``
    test examples, the model's keyword inputs for that batch)."""
    import lra.train_task  # noqa: F401  (registers the LRA tasks)
    from sbm_jax.models import build_model
    from sbm_jax.tasks import build_task
    from sbm_jax.training.checkpoints import RunCheckpoints
    from sbm_jax.training.state import create_train_state

    cfg = _config(summary)
    task = build_task(cfg)
    model = build_model(cfg.model, task.head)
    batch = next(iter(task.test_splits["test"]()))
    batch = {k: v[:num_inputs] for k, v in batch.items()}
    state = create_train_state(cfg, model, task, batch)
    run = summary.get("run_dir") or summary["output_dir"]  # where it is now
    ckpts = RunCheckpoints(os.path.join(run, "checkpoints"))
    restored = ckpts.restore_best(state) or ckpts.restore_latest(state)
    ckpts.close()
    if restored is None:
        raise ReportError(f"no checkpoint under {run} for its density maps (--num_maps=0: none)")
    return model, restored[0].params, batch, task.model_inputs(batch)


def _sown_maps(summary: dict[str, Any], num_inputs: int) -> tuple[dict, dict]:
    """(test batch, :func:`sown_token_densities` of the run's model on it)."""
    model, params, batch, inputs = load_test_examples(summary, num_inputs)
    return batch, sown_token_densities(model, params, inputs)


def token_density_maps(
    summary: dict[str, Any], num_inputs: int, which: str = "query"
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs [num, L], per-layer token density [num, layers, L], heads averaged) for the
    first test inputs at the run's best checkpoint.

    ``which="query"``: the expected density of query ``i``, ``mean_j p_ij`` over real
    keys (the expected fraction of tokens ``i`` attends to); ``"key"``: of key ``j``,
    ``mean_i p_ij`` (the fraction of tokens that attend to ``j``). Both are what the SBM
    layers sow (``query_density`` / ``key_density``), not recomputed here.
    """
    if which not in ("query", "key"):
        raise ValueError(f"which={which!r} must be 'query' or 'key'")
    batch, sown = _sown_maps(summary, num_inputs)
    maps = [np.mean(layer[f"{which}_density"], axis=1) for layer in sown.values()]
    return np.asarray(batch["inputs"]), np.stack(maps, axis=1)


def density_map_figure(summary: dict[str, Any], path: str, num_inputs: int) -> dict[str, Any]:
    """Figs. 7-8: for each of the first test inputs of a pixel task's SBM run, the input
    (titled with its label) and, per layer and head, each pixel's expected key density
    (the fraction of pixels that attend to it, ``key_density``) as a 32 x 32 map titled
    with that head's sampled density on this input (``density``), all as the model sows
    them. Returns what was drawn: ``{"path", "density" [num, layers, heads],
    "key_density" [num, layers, heads, L]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch, sown = _sown_maps(summary, num_inputs)
    inputs = np.asarray(batch["inputs"])
    labels = np.asarray(batch["targets"]) if "targets" in batch else None
    keys = np.stack([layer["key_density"] for layer in sown.values()], axis=1)
    dens = np.stack([layer["density"] for layer in sown.values()], axis=1)  # [num, layers, H]
    num, layers, heads, length = keys.shape
    side = int(round(math.sqrt(length)))
    cols = 1 + layers * heads
    fig, axes = plt.subplots(num, cols, figsize=(2.0 * cols, 2.1 * num), squeeze=False)
    for i in range(num):
        axes[i, 0].imshow(inputs[i].reshape(side, side), cmap="gray")
        axes[i, 0].set_title("input" if labels is None else f"label {int(labels[i])}", fontsize=8)
        for layer in range(layers):
            for head in range(heads):
                ax = axes[i, 1 + layer * heads + head]
                ax.imshow(keys[i, layer, head].reshape(side, side), cmap="viridis")
                ax.set_title(f"L{layer + 1}H{head + 1}: {dens[i, layer, head]:.3f}", fontsize=8)
        for ax in axes[i]:
            ax.axis("off")
    fig.suptitle("colour: fraction of pixels attending to a pixel; title: head density", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"path": path, "density": dens, "key_density": keys}


def make_report(root: str, out: str, num_maps: int = 3) -> dict[str, Any]:
    """Write every table and figure for the summaries under ``root`` into ``out``."""
    if not os.path.isdir(root):
        raise ReportError(f"--root={root!r} is not a directory")
    notes: list[str] = []
    summaries = load_summaries(root, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not summaries:
        raise ReportError(f"no finished LRA run (summary.json) under --root={root!r}")
    check_groups(summaries)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ReportError(f"--out={out!r} is a file, not a directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ReportError(f"--out={out!r} cannot be created: {e.strerror or e}") from None
    report: dict[str, Any] = {"runs": len(summaries), "files": [], "left_out": notes}
    for name, fn in (
        ("table1_accuracy", table1),
        ("table2_lambda", table2),
        ("table3_cost", table3),
    ):
        text, numbers = fn(summaries)
        with open(os.path.join(out, name + ".md"), "w", encoding="utf-8") as f:
            f.write(text)
        report[name] = numbers
        report["files"].append(os.path.join(out, name + ".md"))
    fig5 = figure5(summaries, os.path.join(out, "fig5_density_per_layer.png"))
    if fig5:
        report["files"].append(fig5)
    tradeoff = figure_tradeoff(summaries, os.path.join(out, "table2_tradeoff.png"))
    if tradeoff:
        report["files"].append(tradeoff)
    if num_maps > 0:
        for task, fig in (
            ("image", "fig7_image_density"),
            ("pathfinder", "fig8_pathfinder_density"),
        ):
            runs = [s for s in summaries if s["attention"] == "sbm" and s["task_short"] == task]
            # The run of fig. 5 and Table 1 (lambda 0, lowest seed) where there is one.
            runs.sort(key=lambda s: (bool(s.get("density_lambda")), s.get("seed", 0)))
            if runs:
                drawn = density_map_figure(runs[0], os.path.join(out, fig + ".png"), num_maps)
                report["files"].append(drawn["path"])
                report[fig] = {
                    "head_density": drawn["density"].tolist(),
                    "run": runs[0]["run_dir"],
                    "density_lambda": float(runs[0].get("density_lambda") or 0.0),
                }
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=float)
    return report


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise script_usage.UsageError(f"unexpected arguments: {argv[1:]}")
    report = make_report(_ROOT.value, _OUT.value, _MAPS.value)
    for path in report["files"]:
        print(path)
        if path.endswith(".md"):
            with open(path, encoding="utf-8") as f:
                print(f.read())


if __name__ == "__main__":
    script_usage.run(main)
