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
  Image / Pathfinder, the input and, per SBM layer, each token's expected attention
  density (the mean over keys of the edge probability ``p_ij``, heads averaged) at the
  best checkpoint (figs. 7, 8). Needs the run's checkpoint and data.
* ``report.json``: every number above.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

TASK_ORDER = ("listops", "text", "retrieval", "image", "pathfinder")

_ROOT = flags.DEFINE_string("root", "runs/lra", "Directory searched for summary.json files.")
_OUT = flags.DEFINE_string("out", "reports/lra", "Output directory.")
_MAPS = flags.DEFINE_integer("num_maps", 3, "Inputs per density-map figure (0: none).")


def load_summaries(root: str) -> list[dict[str, Any]]:
    """All LRA run summaries under ``root`` (runs stopped early have none)."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "summary.json"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        if str(summary.get("task", "")).startswith("lra_"):
            summary["task_short"] = summary["task"][len("lra_") :]
            out.append(summary)
    return out


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


def token_density_maps(summary: dict[str, Any], num_inputs: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs [num, L], per-layer expected token density [num, layers, L]) for the
    first test inputs at the run's best checkpoint.

    The expected density of query ``i`` is ``mean_j min(1, q_i^T S k_j)`` over real keys
    ``j`` (memberships and block matrix of the SBM layer; heads averaged): the expected
    fraction of tokens ``i`` attends to, computed from the layer's own input (captured
    with ``capture_intermediates``) and parameters.
    """
    import jax
    import jax.numpy as jnp

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
    ckpts = RunCheckpoints(os.path.join(summary["output_dir"], "checkpoints"))
    restored = ckpts.restore_best(state) or ckpts.restore_latest(state)
    ckpts.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint under {summary['output_dir']}")
    params = restored[0].params
    _, inter = model.apply(
        {"params": params},
        **task.model_inputs(batch),
        deterministic=True,
        rngs={"sample": jax.random.PRNGKey(0)},
        capture_intermediates=lambda mdl, _: (
            mdl.name is not None and mdl.name.startswith("ln_attention")
        ),
        mutable=["intermediates"],
    )
    flat = jax.tree_util.tree_flatten_with_path(inter["intermediates"])[0]
    ln_outputs = {}
    for path, value in flat:
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        block = "/".join(str(k) for k in keys if isinstance(k, str) and k != "__call__")
        ln_outputs[block] = value
    attn_params = {}
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(p, "key", "")) for p in path]
        if "attention" in keys:
            i = keys.index("attention")
            attn_params.setdefault("/".join(keys[:i]), {})["/".join(keys[i + 1 :])] = value
    mask = jnp.asarray(batch["mask"])
    shared = bool(cfg.model.attention_options.get("shared_mlp", False))
    maps = []
    for block in sorted(attn_params):
        p = attn_params[block]
        x = ln_outputs[block + "/ln_attention"]
        q = jnp.einsum("bld,dhe->blhe", x, p["query/kernel"]) + p["query/bias"]
        k = jnp.einsum("bld,dhe->blhe", x, p["key/kernel"]) + p["key/bias"]
        eq = "blhd,de->blhe" if shared else "blhd,hde->blhe"

        def embed(t, p=p, eq=eq):
            h = jax.nn.relu(jnp.einsum(eq, t, p["mlp_w1"]) + p["mlp_b1"])
            return jnp.einsum(eq, h, p["mlp_w2"]) + p["mlp_b2"]

        c = p["clusters"]
        qm = jax.nn.sigmoid(jnp.einsum("blhd,hkd->bhlk", embed(q), c))
        km = jax.nn.sigmoid(jnp.einsum("blhd,hkd->bhlk", embed(k), c))
        heads, kk = c.shape[0], c.shape[1]
        block_s = jax.nn.softmax(
            jnp.einsum("hkd,hjd->hkj", c, c).reshape(heads, -1), axis=-1
        ).reshape(heads, kk, kk)
        prob = jnp.minimum(jnp.einsum("bhik,hkj,bhlj->bhil", qm, block_s, km), 1.0)
        real = mask[:, None, None, :].astype(jnp.float32)
        dens = jnp.sum(prob * real, -1) / jnp.maximum(jnp.sum(real, -1), 1.0)
        maps.append(jnp.mean(dens, axis=1))  # [num, L]
    return np.asarray(batch["inputs"]), np.stack([np.asarray(m) for m in maps], axis=1)


def density_map_figure(summary: dict[str, Any], path: str, num_inputs: int) -> str:
    """Inputs and per-layer token density maps (32 x 32) of a pixel task's SBM run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs, maps = token_density_maps(summary, num_inputs)
    num, layers, length = maps.shape
    side = int(round(math.sqrt(length)))
    fig, axes = plt.subplots(num, layers + 1, figsize=(2.2 * (layers + 1), 2.2 * num))
    axes = np.atleast_2d(axes)
    for i in range(num):
        axes[i, 0].imshow(inputs[i].reshape(side, side), cmap="gray")
        axes[i, 0].set_title("input", fontsize=8)
        for layer in range(layers):
            im = axes[i, layer + 1].imshow(maps[i, layer].reshape(side, side), cmap="viridis")
            axes[i, layer + 1].set_title(f"layer {layer + 1} density", fontsize=8)
            fig.colorbar(im, ax=axes[i, layer + 1], fraction=0.046)
        for ax in axes[i]:
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_report(root: str, out: str, num_maps: int = 3) -> dict[str, Any]:
    """Write every table and figure for the summaries under ``root`` into ``out``."""
    summaries = load_summaries(root)
    if not summaries:
        raise FileNotFoundError(f"no LRA summary.json under {root!r}")
    os.makedirs(out, exist_ok=True)
    report: dict[str, Any] = {"runs": len(summaries), "files": []}
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
            if runs:
                path = os.path.join(out, fig + ".png")
                report["files"].append(density_map_figure(runs[0], path, num_maps))
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=float)
    return report


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    report = make_report(_ROOT.value, _OUT.value, _MAPS.value)
    for path in report["files"]:
        print(path)
        if path.endswith(".md"):
            with open(path, encoding="utf-8") as f:
                print(f.read())


if __name__ == "__main__":
    app.run(main)
