"""Run a grid of LRA trainings: tasks x mechanisms x lambdas x seeds, one run each.

  python scripts/lra_sweep.py --tasks=listops,image --mechanisms=sbm,full --seeds=0,1 \
      --scale=paper --root=runs/lra --dry_run
  python scripts/lra_sweep.py --tasks=listops --mechanisms=sbm --lambdas=0,1e-3,1e-2,1e-1

Each run is ``scripts/train.py --config=configs/lra/<task>.py:<mechanism>,<scale>,
lambda=<x>,seed=<s> --output_dir=<root>/<task>/<mechanism>_lambda<x>_seed<s>`` plus the
``--override`` flags, in a subprocess (one at a time; a failed run is reported and the
sweep goes on). Lambdas other than 0 apply to SBM only (other mechanisms sow no
differentiable density), so they run once per seed at lambda 0. A run whose directory
already holds summary.json is skipped; an interrupted one resumes from its checkpoint.
``--dry_run`` prints the commands of the runs it would start (and the finished ones it
would skip) instead. Summaries go to ``lra_report.py``.

Paths: ``--root`` is made absolute (relative to the directory the sweep is started
from) before anything else, and every run directory, log and "done" check lives under
it; runs start in that same directory, so the sweep behaves the same from anywhere.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("listops", "text", "retrieval", "image", "pathfinder")

_TASKS = flags.DEFINE_list("tasks", list(TASKS), "LRA tasks.")
_MECHANISMS = flags.DEFINE_list("mechanisms", ["sbm", "full"], "Attention mechanisms.")
_LAMBDAS = flags.DEFINE_list("lambdas", ["0"], "Density regulariser weights (SBM only).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_SCALE = flags.DEFINE_enum("scale", "paper", ["paper", "reduced", "smoke"], "Config scale.")
_ROOT = flags.DEFINE_string("root", "runs/lra", "Parent directory of the run directories.")
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "Extra flags for every run, e.g. --override=--config.train.num_steps=100."
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")


def run_dir(root: str, task: str, mechanism: str, lam: float, seed: int) -> str:
    """``<root>/<task>/<mechanism>_lambda<lam>_seed<seed>``, absolute."""
    root = os.path.abspath(os.path.expanduser(root))
    return os.path.join(root, task, f"{mechanism}_lambda{lam:g}_seed{seed}")


def commands(
    tasks: list[str],
    mechanisms: list[str],
    lambdas: list[float],
    seeds: list[int],
    scale: str,
    root: str,
    overrides: list[str],
) -> list[tuple[str, list[str]]]:
    """(run directory, argv) for every run of the grid."""
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"--tasks: unknown task {task!r}; choose from {TASKS}")
    out = []
    for task in tasks:
        for mechanism in mechanisms:
            for lam in lambdas if mechanism == "sbm" else [0.0]:
                for seed in seeds:
                    directory = run_dir(root, task, mechanism, lam, seed)
                    preset = f"{mechanism},{scale},lambda={lam:g},seed={seed}"
                    argv = [
                        sys.executable,
                        os.path.join(ROOT, "scripts", "train.py"),
                        f"--config={os.path.join(ROOT, 'configs', 'lra', task + '.py')}:{preset}",
                        f"--output_dir={directory}",
                        *overrides,
                    ]
                    out.append((directory, argv))
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        lambdas = [float(x) for x in _LAMBDAS.value]
        seeds = [int(x) for x in _SEEDS.value]
    except ValueError as e:
        raise app.UsageError(f"--lambdas / --seeds: {e}") from None
    runs = commands(
        _TASKS.value,
        _MECHANISMS.value,
        sorted(set(lambdas)),
        seeds,
        _SCALE.value,
        os.path.abspath(os.path.expanduser(_ROOT.value)),
        _OVERRIDES.value,
    )
    failed = []
    for directory, cmd in runs:
        line = shlex.join(cmd)
        # Checked before --dry_run, so that a dry run lists exactly what a real one runs.
        if os.path.exists(os.path.join(directory, "summary.json")):
            print(f"skip (done): {directory}", flush=True)
            continue
        if _DRY_RUN.value:
            print(line)
            continue
        print(f"run: {line}", flush=True)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "train.log"), "a", encoding="utf-8") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"  exit {code} -> {directory}", flush=True)
        if code:
            failed.append(directory)
    if failed:
        print(f"{len(failed)} run(s) failed: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
