"""Compare every attention mechanism on the synthetic repeated-token task (paper fig. 4).

Each mechanism trains the fig. 4 model (1 layer, 1 head, width 32) through the shared
training library (``configs/synthetic.py`` quick preset, ``model.attention`` replaced),
then the script writes into ``--output_dir``:

* ``<mechanism>/``: each run's own files (metrics, plot, summary.json);
* ``results.md``: a table of final train loss / accuracy, evaluation loss / accuracy and
  density per mechanism, followed by parameter counts and analytic per-example FLOPs at
  the LRA shapes (n = 1024, 2048, 4096; width 64, 2 heads of 32) from
  ``sbm_jax.analysis.flops``;
* ``results.json`` (the same numbers) and ``comparison.png`` (bar plots).

Options that set a mechanism's budget (Linformer ``proj_len``, Performer
``num_features``, Nystromformer ``num_landmarks``, local ``window``, Reformer
``chunk_len``) default to 256 or 64, more than a short sequence has: at reduced length
they are scaled to ``seq_len // 4`` so that the low-rank and sparse methods stay
approximations (256 of 1024 in LRA). ``--no_scale_budgets`` keeps the defaults.

  python scripts/compare_synthetic.py --steps 300 --seq_len 64 --batch_size 64 \
      --output_dir runs/compare_synthetic
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402

import sbm_jax.tasks as tasks  # noqa: E402  (registers the "synthetic" task)
from configs import synthetic  # noqa: E402
from sbm_jax import script_usage  # noqa: E402
from sbm_jax.analysis import LRA_SEQ_LENS, flops_table  # noqa: E402
from sbm_jax.attention import available  # noqa: E402
from sbm_jax.training import ConfigError, train_and_evaluate  # noqa: E402


def make_config(
    name: str, *, steps: int, seq_len: int, batch_size: int, seed: int, scale_budgets: bool
) -> ml_collections.ConfigDict:
    """The synthetic quick preset with ``model.attention = name`` and the run's sizes."""
    config = synthetic.get_config("full,quick")
    config.name = f"compare_{name}"
    config.seed = seed
    config.task.seq_len = seq_len  # a FieldReference: vocab_size and max_len follow
    config.train.batch_size = batch_size
    config.train.num_steps = steps
    config.train.warmup_steps = min(int(config.train.warmup_steps), steps)
    config.train.log_every = max(1, min(int(config.train.log_every), steps))
    config.model.attention = name
    # Every mechanism from the same independent draw of its projections (docs/mechanisms.md
    # reports the table so): the full preset's tied query/key init would start each
    # mechanism at full attention's best init, and fails on mechanisms without separate
    # query and key projections (reformer's shared QK, tsa).
    config.model.query_key_init = "independent"
    config.model.attention_options = ml_collections.ConfigDict(
        synthetic.mechanism_options(name, seq_len, scale_budgets)
    )
    return config


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def results_markdown(
    runs: list[dict[str, Any]], flops_rows: list[dict[str, Any]], args: argparse.Namespace
) -> str:
    """Markdown: the training table, then parameters and FLOPs at the LRA shapes."""
    lines = [
        f"Synthetic repeated-token task: seq_len {args.seq_len}, batch {args.batch_size}, "
        f"{args.steps} steps, 1 layer, 1 head, width 32, seed {args.seed}. "
        "Train columns: the last step's batch; eval: fresh batches, no dropout.",
        "",
        "| mechanism | options | train loss | train acc | eval loss | eval acc | density "
        "| time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ev = r.get("eval") or {}
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items() if k in r["shown"]) or "-"
        lines.append(
            f"| {r['mechanism']} | {opts} | {_fmt(r['loss'])} | {_fmt(r['accuracy'])} "
            f"| {_fmt(ev.get('loss'))} | {_fmt(ev.get('accuracy'))} | {_fmt(r['density'], 3)} "
            f"| {_fmt(r['wall_time_s'], 1)} |"
        )
    lines += [
        "",
        "Attention layer at the LRA shapes (emb 64, 2 heads of 32, default options): "
        "parameters and analytic per-example GFLOPs (projections included; "
        "`sbm_jax/analysis/flops.py`). SBM is shown at densities 1.0 (bound) and 0.1.",
        "",
    ]
    seq_lens = sorted({r["seq_len"] for r in flops_rows})
    header = "| mechanism | " + " | ".join(f"params n={n}" for n in seq_lens)
    header += " | " + " | ".join(f"GFLOPs n={n}" for n in seq_lens) + " |"
    lines += [header, "|---" * (1 + 2 * len(seq_lens)) + "|"]
    labels: dict[str, dict[int, dict[str, Any]]] = {}
    for row in flops_rows:
        label = row["mechanism"]
        if row.get("density") is not None:
            label += f" (density {row['density']})"
        labels.setdefault(label, {})[row["seq_len"]] = row
    for label, by_n in labels.items():
        params = " | ".join(f"{by_n[n]['params']:,}" for n in seq_lens)
        gflops = " | ".join(f"{by_n[n]['flops'] / 1e9:.3f}" for n in seq_lens)
        lines.append(f"| {label} | {params} | {gflops} |")
    return "\n".join(lines) + "\n"


def plot_results(runs: list[dict[str, Any]], path: str) -> str:
    """Bars of final eval loss and accuracy per mechanism (density written on the bars)."""
    names = [r["mechanism"] for r in runs]
    ev = [(r.get("eval") or {}) for r in runs]
    loss = [e.get("loss", r["loss"]) or 0.0 for e, r in zip(ev, runs, strict=True)]
    acc = [e.get("accuracy", r["accuracy"]) or 0.0 for e, r in zip(ev, runs, strict=True)]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(names) + 4), 4))
    axes[0].bar(names, loss, color="tab:red")
    axes[0].set_title("final eval loss")
    bars = axes[1].bar(names, acc, color="tab:blue")
    axes[1].set_title("final eval accuracy")
    axes[1].set_ylim(0.0, 1.05)
    axes[1].axhline(1.0, color="gray", lw=0.5)
    for bar, r in zip(bars, runs, strict=True):
        if r.get("density") is not None:
            axes[1].text(
                bar.get_x() + bar.get_width() / 2,
                0.02,
                f"d={r['density']:.2f}",
                ha="center",
                rotation=90,
                fontsize=7,
                color="white",
            )
    for ax in axes:
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per mechanism")
    parser.add_argument("--seq_len", type=int, default=64, help="sequence length N")
    parser.add_argument("--batch_size", type=int, default=64, help="sequences per step")
    parser.add_argument("--seed", type=int, default=0, help="config.seed of every run")
    parser.add_argument(
        "--mechanisms", default="all", help="comma-separated registry names, or 'all'"
    )
    parser.add_argument("--output_dir", default="runs/compare_synthetic")
    parser.add_argument(
        "--flops_seq_lens",
        default=",".join(str(n) for n in LRA_SEQ_LENS),
        help="lengths of the parameter / FLOP table (comma-separated)",
    )
    parser.add_argument(
        "--no_scale_budgets",
        action="store_true",
        help="keep the mechanisms' default budgets (proj_len, num_features, ...)",
    )
    args = parser.parse_args(argv)
    for field in ("steps", "seq_len", "batch_size"):
        if getattr(args, field) < 1:
            parser.error(f"--{field}={getattr(args, field)} must be >= 1")
    names = available() if args.mechanisms == "all" else args.mechanisms.split(",")
    unknown = [n for n in names if n not in available()]
    if unknown:
        parser.error(f"--mechanisms: {unknown} are not registered; choose from {available()}")
    args.mechanism_list = list(dict.fromkeys(names))
    try:
        args.flops_seq_len_list = [int(n) for n in args.flops_seq_lens.split(",") if n]
    except ValueError:
        parser.error(f"--flops_seq_lens={args.flops_seq_lens!r}: comma-separated integers")
    if not args.flops_seq_len_list or min(args.flops_seq_len_list) < 1:
        parser.error(f"--flops_seq_lens={args.flops_seq_lens!r}: lengths must be >= 1")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        parser.error(f"--output_dir={args.output_dir!r} is a file")
    previous = _previous_results(args.output_dir)
    if previous is not None:
        settings = {k: previous["args"].get(k) for k in SETTINGS}
        mine = {k: getattr(args, k) for k in SETTINGS}
        if settings != mine:
            differ = ", ".join(
                f"--{k} {settings[k]} -> {mine[k]}" for k in SETTINGS if settings[k] != mine[k]
            )
            parser.error(
                f"--output_dir={args.output_dir!r} holds a comparison with other settings "
                f"({differ}): choose another --output_dir"
            )
    return args


#: What makes two comparisons comparable: their runs share one results table.
SETTINGS = ("steps", "seq_len", "batch_size", "seed", "no_scale_budgets")


def _previous_results(output_dir: str) -> dict[str, Any] | None:
    """``results.json`` of an earlier comparison in ``output_dir``, if readable."""
    try:
        with open(os.path.join(output_dir, "results.json"), encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError):
        return None
    return results if isinstance(results, dict) and "runs" in results else None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train every requested mechanism, write the table, JSON and plot; return the results."""
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    # An earlier comparison here (same settings: parse_args checked) keeps its other
    # mechanisms' rows; the ones asked for now are trained (or resumed) again.
    previous = _previous_results(args.output_dir) or {"runs": []}
    kept = [r for r in previous["runs"] if r.get("mechanism") not in args.mechanism_list]
    runs = []
    for name in args.mechanism_list:
        config = make_config(
            name,
            steps=args.steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            seed=args.seed,
            scale_budgets=not args.no_scale_budgets,
        )
        print(f"== {name}: {config.model.attention_options.to_dict()}", flush=True)
        try:
            summary = train_and_evaluate(
                config,
                tasks.build_task(config),
                output_dir=os.path.join(args.output_dir, name),
                progress_stream=sys.stderr,
            )
        except ConfigError as e:  # e.g. a run of other settings in <output_dir>/<name>
            script_usage.fail(e)
        if "stopped_at" in summary:  # SIGTERM / Ctrl-C: the run saved its checkpoint
            print(
                f"stopped at step {summary['stopped_at']} of {name} ({summary['reason']}); "
                "the same command resumes it",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + int(getattr(signal, str(summary["reason"]), -127)))
        # wall_time_s: the trainer's, over every session of the run (a resumed run's
        # own session would show only the resume).
        summary["mechanism"] = name
        summary["options"] = config.model.attention_options.to_dict()
        summary["shown"] = sorted(
            set(config.model.attention_options) & set(synthetic.BUDGET_OPTIONS.values())
        )
        runs.append(summary)
        ev = summary.get("eval") or {}
        print(
            f"   {name}: loss {_fmt(summary['loss'])} acc {_fmt(summary['accuracy'])} "
            f"eval acc {_fmt(ev.get('accuracy'))} density {_fmt(summary['density'], 3)} "
            f"({summary['wall_time_s']:.0f} s)",
            flush=True,
        )
    order = {name: i for i, name in enumerate(available())}
    runs = sorted(kept + runs, key=lambda r: order.get(r["mechanism"], len(order)))
    names = [r["mechanism"] for r in runs]
    flops_rows = flops_table(names, args.flops_seq_len_list)
    if "sbm" in names:
        flops_rows += flops_table(["sbm"], args.flops_seq_len_list, densities={"sbm": 0.1})
    markdown = results_markdown(runs, flops_rows, args)
    with open(os.path.join(args.output_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    saved_args = {**vars(args), "mechanism_list": names}  # every row's mechanism
    results = {"args": saved_args, "runs": runs, "flops": flops_rows}
    with open(os.path.join(args.output_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=str)
    results["plot"] = plot_results(runs, os.path.join(args.output_dir, "comparison.png"))
    results["markdown"] = markdown
    print(markdown, flush=True)
    return results


if __name__ == "__main__":
    main()
